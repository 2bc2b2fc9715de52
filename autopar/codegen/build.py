"""Builds this rank's StagePrograms from the exported graph and the plan.

Values that cross a pipeline boundary are computed once: `live_in(c)` are the values produced
before chunk c (model inputs count as produced before chunk 0) and read by chunk c or a later
one; chunk c receives them from chunk c - 1 and passes on what later chunks still need.
Python numbers (symbolic sizes) cross as 0-dim tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.capture.compute_dtype import COMPUTE_DTYPES
from autopar.codegen.align import align_names
from autopar.codegen.async_tp import AsyncTP
from autopar.codegen.async_tp import chosen_kernel as async_tp_kernel
from autopar.codegen.fused_wgrad import FusedWgrad, chosen_kernel
from autopar.codegen.interpreter import PlannedInterpreter, RunStats
from autopar.codegen.program import (GraphParts, SegmentModule, StageProgram, WeightCasts, distribute_parameter,
                                     recomputable_nodes)
from autopar.codegen.recompute import checkpoint_regions, kept_nodes, region_nodes
from autopar.errors import ConfigError, PlanMismatchError
from autopar.solver.recompute import op_saved_nodes
from autopar.solver.recompute_blocks import recomputed_names, segment_mode
from autopar.plans.plan import Plan
from autopar.solver.configs import ZERO_BUBBLE_SCHEDULES
from autopar.solver.pipeline import rank_of, stages_of_rank
from autopar.solver.step_tail import fsdp_fuses_wgrad


@dataclass
class ChunkSpec:
    index: int
    segments: list[str]
    inputs: list[str]
    outputs: list[str]


def plan_chunks(plan: Plan, parts: GraphParts) -> list[list[str]]:
    """Segment names of every pipeline chunk, in pipeline order (one chunk when pp = 1)."""
    present = {segment.name for segment in parts.graph.segments}
    if plan.mesh["pp"] == 1:
        return [[segment.name for segment in parts.graph.segments]]
    per_device = [list(stage.chunks or (stage.segments,)) for stage in plan.stages]
    num_chunks, pp = len(per_device[0]), len(per_device)
    ordered = []
    for stage in range(num_chunks * pp):
        device = rank_of(plan.schedule, stage=stage, num_ranks=pp)
        local = stages_of_rank(plan.schedule, rank=device, num_ranks=pp, num_chunks=num_chunks).index(stage)
        ordered.append(per_device[device][local])
    return [[name for name in chunk if name in present] for chunk in ordered]


def chunk_specs(plan: Plan, parts: GraphParts) -> list[ChunkSpec]:
    chunks = plan_chunks(plan, parts)
    segment_of = parts.segment_of()
    chunk_of_segment = {name: index for index, chunk in enumerate(chunks) for name in chunk}
    produced_in: dict[str, int] = {name: -1 for name in parts.user_inputs}
    for name, segment in segment_of.items():
        produced_in[name] = chunk_of_segment[segment]
    last_read: dict[str, int] = {}
    for name, readers in parts.readers().items():
        if name in produced_in:
            positions = [len(chunks) - 1 if reader == "<output>" else chunk_of_segment[reader] for reader in readers]
            last_read[name] = max(positions)
    order = {node.name: position for position, node in enumerate(parts.program.graph.nodes)}
    specs = []
    for index, segments in enumerate(chunks):
        inputs = sorted((name for name, made in produced_in.items() if made < index <= last_read.get(name, -2)),
                        key=order.get)
        if index == len(chunks) - 1:
            outputs = list(parts.outputs)
        else:
            outputs = sorted((name for name, made in produced_in.items() if made <= index < last_read.get(name, -2)),
                             key=order.get)
        specs.append(ChunkSpec(index=index, segments=segments, inputs=inputs, outputs=outputs))
    return specs


def codegen_placements(plan: Plan, parts: GraphParts) -> dict[str, str]:
    """The plan's placements keyed by this graph's names: ops by aligning the two graphs (see
    align.py), model inputs by position."""
    calls = [node.name for node in parts.graph.nodes if node.kind == "call"]
    matched = align_names(list(plan.placements), calls)
    placements = {name: plan.placements[source] for name, source in matched.items()}
    placements.update({node.name: plan.placements[node.name] for node in parts.graph.nodes
                       if node.kind != "call" and node.name in plan.placements})
    for name, placement in zip(parts.user_inputs, plan.input_placements):
        placements[name] = placement
    return placements


def _is_number(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (int, float, torch.SymInt, torch.SymFloat))


class ProgramBuilder:
    """Creates the segment modules and stage programs of the chunks this rank runs."""

    def __init__(self, plan: Plan, parts: GraphParts, model: nn.Module, tp_mesh, device: torch.device,
                 stats: RunStats) -> None:
        self.plan = plan
        self.parts = parts
        self.model = model
        self.device = device
        self.placements = codegen_placements(plan, parts)
        self.interpreter = PlannedInterpreter(self.placements, tp_mesh, stats)
        self.interpreter.recomputed_activations = parts.graph.recomputed_activations
        self.interpreter.parameter_inputs = frozenset(parts.param_of)
        self.recomputable = recomputable_nodes(parts.graph)
        self.op_kept = op_saved_nodes(parts.graph)
        self.readers = parts.readers()
        self.segment_nodes = parts.segment_nodes
        self.params: dict[str, nn.Parameter] = {}
        """FQN -> the distributed parameter (one object per FQN on this rank)."""
        self.buffers: dict[str, torch.Tensor] = {}
        """FQN -> this rank's copy of each buffer its stages read."""
        self.meta_born: set[str] = set()
        """FQNs of the parameters and buffers that were on meta (their storage is still unset)."""
        self.wires: dict[str, str] = {}
        """Boundary tensors sent otherwise than placed (codegen/pipeline.boundary_wires)."""
        self.expert_mesh = None
        """The (tp, ep) mesh of expert weights under expert parallelism (else None)."""
        self.weight_casts = WeightCasts(accumulate_into_grad=plan.schedule not in ZERO_BUBBLE_SCHEDULES)
        """The bf16 weight copies of this rank's modules under bf16 precision (one per step)."""
        kernel = chosen_kernel(device) if plan.precision == "bf16" else "off"  # fp8: torchao runs every linear
        if kernel != "off":
            self.interpreter.fused_wgrad = FusedWgrad(self.weight_casts, kernel, stats.fused_wgrad)
        tp_kernel = async_tp_kernel(device, plan.tp_overlap) if plan.precision != "fp8" and tp_mesh.size() > 1 else "off"
        if tp_kernel != "off":  # fp8: torchao's override runs every float8 linear
            self.interpreter.async_tp = AsyncTP(tp_mesh, tp_kernel, stats.async_tp, self.interpreter.fused_wgrad)
        self.fp8 = self._float8_linears()
        """Precision "fp8": the plan's float8 linears (codegen/fp8.py), else None."""
        self.fp8_experts = self._float8_experts()
        """Precision "fp8": the plan's float8 expert grouped matmuls (codegen/fp8_experts.py), else None."""

    def fuse_under_fsdp(self, stages: list[StageProgram]) -> None:
        """After apply_fsdp: where FSDP2 accumulates fp32 unsharded gradients over microbatches
        (solver/step_tail.fsdp_fuses_wgrad, the rule the planner prices), the linears' GEMMs
        accumulate into them (codegen/fused_wgrad.py)."""
        fused, plan = self.interpreter.fused_wgrad, self.plan
        if fused is None or plan.schedule in ZERO_BUBBLE_SCHEDULES or not fsdp_fuses_wgrad(
                zero_stage=plan.zero_stage, pp=plan.mesh["pp"], num_microbatches=plan.num_microbatches,
                offload=plan.offload):
            return
        fused.use_fsdp([module for stage in stages for module in stage.modules() if hasattr(module, "_get_fsdp_state")])

    def _float8_linears(self):
        if self.plan.precision != "fp8":
            return None
        from autopar.codegen.data_parallel import uses_fsdp
        from autopar.codegen.fp8 import Float8Linears

        data_shards = self.plan.mesh["dp"] * self.plan.mesh.get("cp", 1)
        gathered = uses_fsdp(self.plan.zero_stage, data_shards, self.plan.offload)
        fp8 = Float8Linears(self.plan.fp8_recipe or "tensorwise", self.plan.fp8_linears, self.device,
                            fsdp_float8_all_gather=gathered, compiled=self.plan.fp8_casts == "compiled")
        fp8.install(self.interpreter, self.parts.param_of, self.parts.fx_nodes)
        return fp8

    def _float8_experts(self):
        if self.plan.precision != "fp8" or not getattr(self.plan, "fp8_experts", ()):
            return None
        from autopar.codegen.fp8_experts import Float8GroupedMM

        experts = Float8GroupedMM(self.plan.fp8_experts, self.device)
        experts.install(self.interpreter, self.parts.param_of, self.parts.fx_nodes)
        return experts

    def use_expert_parallelism(self, runtime, *, folded: bool = False) -> None:
        """Run the plan's expert ops expert-parallel and place its expert weights on the (tp, ep)
        mesh (codegen/experts.py); the expert ops are found in this graph as the planner found them.
        `folded` (etp=1, codegen/expert_folding.py): every chain runs (the layer is on local rows)."""
        from autopar.codegen.experts import ExpertRunner
        from autopar.solver.experts import expert_ops_at, expert_param_names, find_expert_ops

        ops = find_expert_ops(self.parts.graph)
        names = expert_param_names(self.parts.graph, ops)
        if set(names) != set(self.plan.ep_params):
            raise PlanMismatchError(f"the plan splits the expert weights {sorted(self.plan.ep_params)} over ep="
                                    f"{self.plan.ep}, but this model's expert ops read {sorted(names)}: re-plan")
        ops_run = ops if folded else expert_ops_at(ops, self._placements)  # the chains the plan priced
        self.interpreter.experts = ExpertRunner({op.node: op for op in ops_run}, runtime.ep_group, self.plan.ep,
                                                rows=self.interpreter.stats.expert_rows)  # ParallelModule reads them
        self.interpreter.experts.float8 = self.fp8_experts  # the local grouped matmuls after dispatch
        self.expert_mesh = runtime.expert_mesh

    def _placements(self, name: str) -> tuple | None:
        """A node's planned (output, inputs) placements, one per mesh axis each (solver/experts.py)."""
        if name not in self.interpreter.placements:
            return None
        output, inputs = self.interpreter.placements[name]
        return tuple(output.split(",")), tuple(tuple(item.split(",")) for item in inputs)

    def build(self, spec: ChunkSpec, *, num_chunks: int) -> StageProgram:
        recompute = self.plan.stage_recompute(rank_of(self.plan.schedule, stage=spec.index,
                                                      num_ranks=self.plan.mesh["pp"]))
        # "blocks:<N>": the first N blocks of each chunk run as under "full", the rest as under "none"
        recomputed = recomputed_names(self.parts.graph.segments, mode=recompute, num_chunks=num_chunks,
                                      split=self.plan.pipeline_split)
        segments = [self._segment(name, spec, segment_mode(recompute, name, recomputed)) for name in spec.segments]
        pipelined = num_chunks > 1
        last = spec.index == num_chunks - 1
        # The last stage's outputs go to the loss: gathered, or this rank's shards for a class-sharded
        # loss (the pipeline's loss function makes DTensors of them again).
        mode = (("shards" if self.plan.loss_parallel else "replicated") if last else "local") if pipelined \
            else "dtensor"
        boundary = set(spec.inputs) - (set(self.parts.user_inputs) if spec.index == 0 else set())
        inputs = list(self.parts.user_inputs) + [name for name in spec.inputs if name not in self.parts.user_inputs] \
            if spec.index == 0 else spec.inputs
        scalars = {name for name in inputs + spec.outputs if _is_number(self.parts.fx_nodes[name])}
        stage = StageProgram(segments, self.interpreter, inputs=inputs, boundary_inputs=boundary if pipelined else set(),
                             outputs=spec.outputs, output_mode=mode, scalars=scalars,
                             placements={name: self.placements.get(name, "R").split("|")[0] for name in inputs},
                             wires=self.wires if pipelined else {})
        stage.owned_outputs = pipelined and self.plan.schedule in ("zb1p", "zbv")
        self._attach_params(stage, segments, spec)
        compute_dtype = COMPUTE_DTYPES.get(self.plan.precision)
        if compute_dtype is not None:  # bf16 compute, fp32 master weights and gradients
            experts = [segment.experts for segment in segments if segment.has_experts]
            for module in [stage, *segments, *experts]:
                module.compute_dtype = compute_dtype
                module.weight_casts = self.weight_casts
        return stage

    def _segment(self, name: str, spec: ChunkSpec, recompute: str) -> SegmentModule:
        node_names = self.segment_nodes[name]
        fx_nodes = [self.parts.fx_nodes[n] for n in node_names]
        inside = set(node_names)
        inputs = sorted({source.name for node in fx_nodes for source in node.all_input_nodes if source.name not in inside})
        produced = [n for n in node_names if n not in self.parts.helpers and self.readers.get(n, set()) - {name}]
        regions = region_nodes(fx_nodes, checkpoint_regions(self.parts.graph, recompute))
        return SegmentModule(name, fx_nodes, self.interpreter, inputs, produced, recompute,
                             regions if regions is not None else self.recomputable,
                             op_kept=kept_nodes(self.parts.graph, recompute) if recompute != "op" else self.op_kept)

    def _attach_params(self, stage: StageProgram, segments: list[SegmentModule], spec: ChunkSpec) -> None:
        """A parameter read by one segment belongs to it; one read by several, to the stage."""
        by_name = {segment.segment_name: segment for segment in segments}
        for placeholder, fqn in {**self.parts.param_of}.items():
            readers = self.readers.get(placeholder, set()) & set(spec.segments)
            if not readers:
                continue
            param = self._parameter(fqn)
            if len(readers) == 1 and self.expert_mesh is not None and fqn in self.plan.ep_params:
                by_name[next(iter(readers))].own_expert_parameter(placeholder, fqn, param)
            elif len(readers) == 1:
                by_name[next(iter(readers))].own_parameter(placeholder, fqn, param)
            elif fqn in self.plan.ep_params and self.plan.zero_stage > 0:
                raise PlanMismatchError(f"the expert weight '{fqn}' is read by several segments ({sorted(readers)}); "
                                        f"ZeRO-{self.plan.zero_stage} shards expert weights per segment: re-plan "
                                        "with zero_stage=0 or ep=1")
            else:
                stage.own_parameter(placeholder, fqn, param)
        for placeholder, fqn in {**self.parts.buffer_of, **self.parts.constant_of}.items():
            if self.readers.get(placeholder, set()) & set(spec.segments):
                stage.fixed_values[placeholder] = self._fixed_value(placeholder, fqn)

    def _parameter(self, fqn: str) -> nn.Parameter:
        if fqn not in self.params:
            placement = self.plan.param_placements.get(fqn, "R")
            original = self.model.get_parameter(fqn)
            if original.device.type == "meta":
                self.meta_born.add(fqn)
            if self.expert_mesh is not None and fqn in self.plan.ep_params:
                from autopar.codegen.experts import distribute_expert_parameter

                self.params[fqn] = distribute_expert_parameter(original, placement, self.expert_mesh, self.device)
            else:
                self.params[fqn] = distribute_parameter(original, placement, self.interpreter.mesh, self.device)
        return self.params[fqn]

    def _fixed_value(self, placeholder: str, fqn: str) -> torch.Tensor:
        if placeholder in self.parts.buffer_of:
            if fqn not in self.buffers:
                original = self.model.get_buffer(fqn)
                if original.device.type == "meta":
                    from autopar.codegen.init import empty_buffer

                    self.meta_born.add(fqn)
                    self.buffers[fqn] = empty_buffer(original, self.device)
                else:
                    self.buffers[fqn] = original.to(self.device)
            return self.buffers[fqn]
        constant = self.parts.program.constants[fqn]
        if constant.device.type == "meta":
            raise ConfigError(f"the model's tensor constant '{fqn}' is on meta, and a constant (not a parameter or "
                              "buffer) cannot be initialised later: register it as a buffer, or build the model on "
                              "a real device")
        return constant.to(self.device)

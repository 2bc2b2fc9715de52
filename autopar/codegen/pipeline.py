"""Pipeline stages and schedules with torch.distributed.pipelining.

Chunk c of the model runs on pipeline rank c mod pp (one chunk per rank, or several with the
interleaved and zb1p schedules), or, under ZB-V, in a V: rank k runs chunks k and 2 pp - 1 - k
(solver/pipeline.py). The zero-bubble schedules (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble) split each backward into torch's input-gradient pass (autograd.grad to
the stage inputs, keeping the intermediate gradients at each parameter's use) and a later
weight-gradient pass from those; they work on CPU/gloo as on GPUs. Stages exchange this rank's local shards; their shapes are known from
the plan, so every PipelineStage gets example inputs and outputs and no shape inference runs.
Weights read on several pipeline ranks (tied embeddings) are kept in one copy per rank whose
gradients are all-reduced after the step, as Megatron-LM's embedding group does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from autopar.capture.compute_dtype import COMPUTE_DTYPES
from autopar.codegen.build import ChunkSpec
from autopar.codegen.program import GraphParts, StageProgram, shared_parameters
from autopar.graph import TensorMeta
from autopar.plans.plan import Plan
from autopar.solver.pipeline import rank_of
from autopar.strategies.placement import boundary_wire, local_shape


def example_tensor(meta: TensorMeta, placement: str, tp: int, device, dtype_override=None) -> torch.Tensor:
    shape = local_shape(meta.shape, [placement], (tp,)) if placement.startswith("S") else meta.shape
    dtype = dtype_override or getattr(torch, meta.dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def boundary_wires(plan: Plan, parts: GraphParts, placements: dict[str, str], specs: list[ChunkSpec]) -> dict[str, str]:
    """The tensors crossing a pipeline boundary that travel otherwise than placed, by name: a
    replicated activation goes as each tp rank's slice and is all-gathered on arrival
    (strategies/placement.boundary_wire; the planner prices it so)."""
    graph = parts.graph.with_batch(plan.microbatch_size) if parts.graph.batch_dynamic else parts.graph
    wires = {}
    for name in {name for spec in specs[1:] for name in spec.inputs}:
        node = graph.by_name.get(name)
        if node is None or not node.outputs:
            continue
        planned = placements.get(name, "R").split("|")[0]
        wire = boundary_wire(node.output.shape, planned, plan.mesh["tp"], floating=node.output.is_float)
        if wire != planned:
            wires[name] = wire
    return wires


class PipelineBuilder:
    """PipelineStages for this rank's chunks and the schedule that drives them."""

    def __init__(self, plan: Plan, parts: GraphParts, placements: dict[str, str], device, pp_group,
                 wires: dict[str, str] | None = None) -> None:
        self.plan = plan
        self.wires = wires or {}
        self.parts = parts
        self.graph = parts.graph.with_batch(plan.microbatch_size) if parts.graph.batch_dynamic else parts.graph
        self.placements = placements
        self.device = device
        self.pp_group = pp_group
        self.tp = plan.mesh["tp"]

    def _examples(self, names: list[str], *, replicated: bool = False, boundary: bool = True) -> tuple[torch.Tensor, ...]:
        examples = []
        for name in names:
            node = self.graph.by_name.get(name)
            if node is None or not node.outputs:  # a Python number crossing the boundary
                examples.append(torch.tensor(0, device=self.device))
                continue
            placement = "R" if replicated else self.wires.get(name) or self.placements.get(name, "R").split("|")[0]
            # Under bf16 what crosses a boundary is sent in bf16 (StageProgram._leave casts fp32).
            compute_dtype = COMPUTE_DTYPES.get(self.plan.precision)
            dtype = compute_dtype if boundary and node.output.dtype == "float32" else None
            example = example_tensor(node.output, placement, self.tp, self.device, dtype_override=dtype)
            # PipelineStage sends gradients back only for inputs whose examples require them.
            examples.append(example.requires_grad_(node.requires_grad and example.is_floating_point()))
        return tuple(examples)

    def stage(self, program: StageProgram, spec: ChunkSpec, num_chunks: int) -> PipelineStage:
        user_inputs = set(self.parts.user_inputs) if spec.index == 0 else set()
        inputs = [self._examples([name], replicated=name in user_inputs, boundary=name not in user_inputs)[0]
                  for name in program.input_names]
        last = spec.index == num_chunks - 1
        outputs = self._examples(spec.outputs, replicated=last and not self.plan.loss_parallel, boundary=not last)
        return PipelineStage(program, spec.index, num_chunks, self.device, input_args=tuple(inputs),
                             output_args=outputs if len(outputs) > 1 else outputs[0], group=self.pp_group)

    def schedule(self, stages: list[PipelineStage], loss_fn):
        m = self.plan.num_microbatches
        multi = {"interleaved": ScheduleInterleaved1F1B, "zb1p": ScheduleInterleavedZeroBubble,
                 "zbv": ScheduleZBVZeroBubble}
        # torch divides each stage's gradients by m after the last backward; a weight two local
        # stages share (ZB-V holds the tied embedding and head on rank 0) would be divided twice:
        # ParallelModule divides once per parameter instead (see shares_parameters), and under
        # ZeRO-0 data parallelism, whose all-reduce starts inside backward (grad_overlap.py).
        scale_grads = not shares_parameters(stages)
        if self.plan.schedule in multi:
            return multi[self.plan.schedule](stages, m, loss_fn=loss_fn, scale_grads=scale_grads)
        kind = ScheduleGPipe if self.plan.schedule == "gpipe" else Schedule1F1B
        return kind(stages[0], m, loss_fn=loss_fn, scale_grads=scale_grads)


_BACKWARD_ACTIONS = frozenset({"B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD"})
"""torch's _ComputationType values of backward work and its communication."""


@contextmanager
def forward_only(schedule) -> Iterator[None]:
    """The schedule's forward actions only, for evaluation. torch's action-list schedules
    (zero-bubble ones) keep their backward actions in `eval()`, where ZB-V's hand-off of an input
    gradient between the two chunks of one rank fails ("can't steal_bwd_input if this stage
    doesn't have backward"). Dropping backward actions and their sends and receives keeps every
    forward dependency of the training order, so the ranks still meet."""
    actions = getattr(schedule, "pipeline_order_with_comms", None)
    if not actions or any(action.computation_type.value == "OVERLAP_F_B" for order in actions.values()
                          for action in order if action is not None):
        yield
        return
    schedule.pipeline_order_with_comms = {
        rank: [action for action in order if action is None or action.computation_type.value not in _BACKWARD_ACTIONS]
        for rank, order in actions.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = actions


def shares_parameters(stages: list[PipelineStage]) -> bool:
    """Whether a parameter object belongs to several of this rank's stages."""
    return bool(shared_parameters([stage.submod for stage in stages]))


def tied_weight_groups(plan: Plan, parts: GraphParts, chunk_segments: list[list[str]], mesh_shape, rank: int):
    """For each parameter read on several pipeline ranks, the process group joining this rank's
    copies (created on every rank in the same order, as new_group requires)."""
    pp, dp, tp = mesh_shape
    readers = parts.readers()
    pp_ranks_of: dict[str, tuple[int, ...]] = {}
    for placeholder, fqn in parts.param_of.items():
        ranks = sorted({rank_of(plan.schedule, stage=chunk, num_ranks=pp) for chunk, segments in enumerate(chunk_segments)
                        if readers.get(placeholder, set()) & set(segments)})
        if len(ranks) > 1:
            pp_ranks_of[fqn] = tuple(ranks)
    groups: dict[tuple[int, ...], object] = {}
    mine: dict[str, object] = {}
    by_ranks: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for fqn, ranks in pp_ranks_of.items():
        by_ranks[ranks].append(fqn)
    for ranks in sorted(by_ranks):
        for dp_index in range(dp):
            for tp_index in range(tp):
                members = [stage * dp * tp + dp_index * tp + tp_index for stage in ranks]
                group = dist.new_group(ranks=members)
                if rank in members:
                    groups[ranks] = group
    for ranks, names in by_ranks.items():
        for fqn in names:
            if ranks in groups:
                mine[fqn] = groups[ranks]
    return mine

"""The rank-local program: one module per segment, grouped into pipeline stages.

The exported graph is cut along the plan's segments (prologue, each block, epilogue). Each
segment becomes an nn.Module that owns the parameters only it uses (as DTensors on the
tensor-parallel mesh) and interprets its nodes; parameters used by several segments of a stage
(tied embeddings) belong to the stage. Segment modules are the units of FSDP sharding and of
activation checkpointing, as transformer blocks are in torchtitan. Parameters are read from the
module attributes inside forward, so FSDP can gather them just in time and free them after.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_unflatten
from torch.utils.checkpoint import checkpoint

from autopar.codegen.interpreter import PlannedInterpreter, contiguous_grad
from autopar.codegen.main_grad import accumulating_copy
from autopar.codegen.recompute import checkpointed, compact_saves, mutating_on_cpu, op_policy_context
from autopar.solver.recompute_modules import is_modules_mode
from autopar.codegen.placements import to_dtensor_placement
from autopar.graph import OpGraph
from autopar.solver.evaluate import is_recomputable


def attribute_name(fqn: str) -> str:
    return fqn.replace(".", "__")


@dataclass
class GraphParts:
    """The exported program, indexed for building stages."""

    program: object
    graph: OpGraph
    fx_nodes: dict[str, torch.fx.Node]
    param_of: dict[str, str] = field(default_factory=dict)
    """placeholder -> parameter FQN."""
    buffer_of: dict[str, str] = field(default_factory=dict)
    constant_of: dict[str, str] = field(default_factory=dict)
    user_inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    """The model's tensor outputs, in the order of its flattened return value."""
    output_specs: list = field(default_factory=list)
    """Per flattened output: its node name, or ("constant", value) for a non-tensor one."""
    out_spec: object = None
    """pytree spec of what the model returns (a tensor, tuple, dict, ModelOutput...)."""
    segment_nodes: dict[str, list[str]] = field(default_factory=dict)
    """Per segment, the nodes it runs: its ops, each preceded by the size arithmetic it reads
    (sym_size and friends are not ops of the graph: every segment computes its own copy)."""
    helpers: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, program, graph: OpGraph) -> "GraphParts":
        parts = cls(program=program, graph=graph, fx_nodes={node.name: node for node in program.graph.nodes})
        parts._find_helpers()
        first_name: dict[int, str] = {}
        for spec in program.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                # A tied weight is lifted once per name: every name maps to the first, one Parameter.
                tensor = program.state_dict.get(spec.target)
                parts.param_of[name] = first_name.setdefault(id(tensor), spec.target) if tensor is not None \
                    else spec.target
            elif spec.kind == InputKind.BUFFER:
                parts.buffer_of[name] = spec.target
            elif spec.kind == InputKind.USER_INPUT:
                parts.user_inputs.append(name)
            else:
                parts.constant_of[name] = spec.target
        parts.outputs = [name for name in program.graph_signature.user_outputs if name in parts.fx_nodes]
        for spec in program.graph_signature.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                continue
            name = getattr(spec.arg, "name", None)
            parts.output_specs.append(name if name in parts.fx_nodes else ("constant", getattr(spec.arg, "value", None)))
        parts.out_spec = program.call_spec.out_spec
        return parts

    def model_output(self, values: tuple):
        """The model's return value rebuilt from its tensor outputs (in `outputs` order)."""
        remaining = iter(values)
        leaves = [next(remaining) if isinstance(spec, str) else spec[1] for spec in self.output_specs]
        if self.out_spec is None:
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        return tree_unflatten(leaves, self.out_spec)

    def _find_helpers(self) -> None:
        known = self.graph.by_name
        for segment in self.graph.segments:
            ordered: list[str] = []
            for name in segment.nodes:
                self._add_helpers(self.fx_nodes[name], known, ordered)
                ordered.append(name)
            self.segment_nodes[segment.name] = ordered

    def _add_helpers(self, node, known, ordered: list[str]) -> None:
        for source in node.all_input_nodes:
            if source.op == "call_function" and source.name not in known and source.name not in ordered:
                self._add_helpers(source, known, ordered)
                ordered.append(source.name)
                self.helpers.add(source.name)

    def segment_of(self) -> dict[str, str]:
        return {name: segment.name for segment in self.graph.segments for name in segment.nodes}

    def readers(self) -> dict[str, set[str]]:
        """Node -> the segments whose ops read it ("<output>" for the model outputs)."""
        found: dict[str, set[str]] = defaultdict(set)
        for segment, names in self.segment_nodes.items():
            for name in names:
                for source in self.fx_nodes[name].all_input_nodes:
                    if source.name not in self.helpers:
                        found[source.name].add(segment)
        for name in self.outputs:
            found[name].add("<output>")
        return found


class WeightCasts:
    """Mixed precision's compute-dtype copies of fp32 weights, made once per training step.

    Inside `step()` (ParallelModule.train_step, eval_step) a weight is cast once and every
    microbatch uses that copy; the copy's autograd node (which saves no tensor) is shared, so
    each microbatch's backward adds its gradient into the fp32 parameter's .grad in one kernel
    (main_grad.AccumulatingCast; a plain cast under zero-bubble schedules): the gradients a cast
    per use gives, without a cast per microbatch, a copy per microbatch in flight, or a separate
    cast-and-add pass per microbatch. Outside a step (`pm(inputs)` and a backward of the user's own) every
    use casts afresh. Under FSDP2 the gathered parameters are already bf16 (its
    MixedPrecisionPolicy, codegen/data_parallel.py) and nothing is cast here."""

    def __init__(self, *, accumulate_into_grad: bool = True) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._masters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id(copy) -> (copy, weight) of this step's copies."""
        self.num_casts = 0
        """Casts made so far (inside and outside steps)."""
        self.accumulate_into_grad = accumulate_into_grad
        self.before_step: list = []
        """Called on entering each step, before any cast (precision "fp8": the float8 weights'
        scales for FSDP2's float8 all-gathers, after the previous optimizer step)."""
        """A step's copies add their gradients into the fp32 .grad in one kernel (main_grad.py);
        False (zero-bubble schedules): plain casts, autograd casts back and accumulates."""

    @contextmanager
    def step(self, weights: list[tuple[torch.Tensor, torch.dtype]] = ()):
        """Copies made inside serve until the end; `weights` are cast on entry (before the first
        forward, so a later pipeline stage casts while it waits for its first microbatch)."""
        for call in self.before_step:
            call()
        self._copies, self._masters = {}, {}
        try:
            for weight, dtype in weights:
                self.cast(weight, dtype)
            yield
        finally:
            self._copies, self._masters = None, {}

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._copies is None:
            self.num_casts += 1
            return weight.to(dtype)
        held = self._copies.get(id(weight))
        if held is None or held[0] is not weight:
            self.num_casts += 1
            copy = accumulating_copy(weight, dtype) if self.accumulate_into_grad else weight.to(dtype)
            held = self._copies[id(weight)] = (weight, copy)
            self._masters[id(copy)] = (copy, weight)
        return held[1]

    @property
    def in_step(self) -> bool:
        """Inside `step()` (a training or evaluation step of ParallelModule)."""
        return self._copies is not None

    def master_of(self, value) -> torch.Tensor | None:
        """The fp32 weight whose step copy `value` is, when that copy accumulates into `.grad`
        (fused_wgrad.py may then accumulate in its place); else None."""
        held = self._masters.get(id(value)) if self._copies is not None and self.accumulate_into_grad else None
        return held[1] if held is not None and held[0] is value else None


class ParameterOwner(nn.Module):
    """Registers plan parameters under safe attribute names and reads them back in forward
    (where FSDP has swapped in the gathered ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.param_attrs: dict[str, str] = {}
        self.compute_dtype: torch.dtype | None = None
        """Mixed precision: fp32 parameters are used in this dtype (autograd keeps fp32 grads)."""
        self.weight_casts: WeightCasts | None = None
        """Where the compute-dtype copies of fp32 parameters come from (shared by a rank's modules)."""

    def own_parameter(self, placeholder: str, fqn: str, param: nn.Parameter) -> None:
        attr = attribute_name(fqn)
        self.register_parameter(attr, param)
        self.param_attrs[placeholder] = attr

    def cast_weights(self) -> list[tuple[torch.Tensor, torch.dtype]]:
        """The fp32 parameters this module uses in the compute dtype, with that dtype."""
        if self.compute_dtype is None:
            return []
        weights = (getattr(self, attr) for attr in self.param_attrs.values())
        return [(weight, self.compute_dtype) for weight in weights if weight.dtype == torch.float32]

    def _params(self) -> dict[str, torch.Tensor]:
        return {placeholder: self._weight(getattr(self, attr)) for placeholder, attr in self.param_attrs.items()}


    def _weight(self, value: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None or value.dtype != torch.float32:
            return value
        if self.weight_casts is None:
            return value.to(self.compute_dtype)
        return self.weight_casts.cast(value, self.compute_dtype)

    def in_compute_dtype(self, value):
        if self.compute_dtype is not None and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            return value.to(self.compute_dtype)
        return value


class ExpertWeights(ParameterOwner):
    """The expert weights one segment reads (split by expert over ep), in a module of their own:
    under ZeRO-1/2/3 FSDP2 shards them over the dp ranks that hold the same experts (`dp_rep`,
    codegen/data_parallel.py), apart from the segment's other weights (sharded over all dp ranks),
    as torchtitan shards a MoE layer's experts. The segment runs its nodes through this module's
    forward, so FSDP2 gathers the experts before the nodes run and, under ZeRO-3, again before
    their backward (its hooks on this module's outputs)."""

    def forward(self, run, values: dict) -> dict:
        return run(values)


class SegmentModule(ParameterOwner):
    """Runs one segment's nodes; owns the parameters only it reads."""

    def __init__(self, name: str, nodes: list[torch.fx.Node], interpreter: PlannedInterpreter,
                 inputs: list[str], produced: list[str], recompute: str, recomputable: set[str],
                 op_kept: set[str] = frozenset()) -> None:
        super().__init__()
        self.segment_name = name
        self.nodes = nodes
        self.interpreter = interpreter
        self.input_names = inputs
        self.produced = produced
        self.recompute = recompute
        self.recomputable = recomputable
        self.op_kept = op_kept
        """Nodes whose outputs the "op" or "modules:<kinds>" mode keeps (codegen/recompute.kept_nodes)."""
        self.cpu_recomputed = mutating_on_cpu(nodes, op_kept)
        """Kept nodes run again in backward where they run on the CPU (codegen/recompute.mutating_on_cpu)."""

    def own_expert_parameter(self, placeholder: str, fqn: str, param: nn.Parameter) -> None:
        """An expert weight: held by the `experts` child module (ExpertWeights)."""
        if not self.has_experts:
            self.experts = ExpertWeights()
        self.experts.own_parameter(placeholder, fqn, param)

    @property
    def has_experts(self) -> bool:
        return isinstance(getattr(self, "experts", None), ExpertWeights)

    def forward(self, values: dict):
        if self.has_experts:
            return self.experts(self._forward, values)
        return self._forward(values)

    def _params(self) -> dict[str, torch.Tensor]:
        params = super()._params()
        if self.has_experts:
            experts = self.experts
            params.update({placeholder: self._weight(getattr(experts, attr))
                           for placeholder, attr in experts.param_attrs.items()})
        return params

    def _forward(self, values: dict):
        if checkpointed(self.recompute):
            names = [name for name, value in values.items() if isinstance(value, torch.Tensor)]
            others = {name: value for name, value in values.items() if name not in names}
            options = {"context_fn": op_policy_context(self.interpreter, self.op_kept, self.cpu_recomputed)} \
                if self.recompute == "op" else {}
            results = checkpoint(self._run_all, names, others, *[values[name] for name in names], use_reentrant=False,
                                 **options)
            return dict(zip(self.produced, results))
        env = {**values, **self._params()}
        if self.recompute == "selective":
            self._run_selective(env)
        elif is_modules_mode(self.recompute):
            self._run_regions(env)
        else:
            with compact_saves(self.interpreter, regather=self.recompute == "gathers"):
                self.interpreter.run_nodes(self.nodes, env, local=True)
        return {name: env[name] for name in self.produced}

    def _run_all(self, names: list[str], others: dict, *tensors: torch.Tensor) -> tuple:
        env = {**others, **dict(zip(names, tensors)), **self._params()}
        self.interpreter.run_nodes(self.nodes, env)
        return tuple(env[name] for name in self.produced)

    def _run_selective(self, env: dict) -> None:
        """Runs of parameter-free nodes are recomputed in backward; the rest is kept."""
        for run, recompute in _runs(self.nodes, self.recomputable):
            if not recompute:
                with compact_saves(self.interpreter, regather=True):
                    self.interpreter.run_nodes(run, env)
                continue
            self._checkpointed(run, env, lambda name: self._shard_before_checkpoint(run, name, env))

    def _run_regions(self, env: dict) -> None:
        """"modules:<kinds>": each region (`recomputable` holds their nodes) runs as a selective
        checkpoint keeping `op_kept`; the nodes between run as under "none"."""
        for run, region in _runs(self.nodes, self.recomputable):
            if not region:
                with compact_saves(self.interpreter, regather=False):
                    self.interpreter.run_nodes(run, env)
                continue
            self._checkpointed(run, env, env.__getitem__,
                               context_fn=op_policy_context(self.interpreter, self.op_kept, self.cpu_recomputed))

    def _checkpointed(self, run: list[torch.fx.Node], env: dict, kept_input, **checkpoint_kwargs) -> None:
        """Runs `run` under torch.utils.checkpoint from the tensors it reads from outside
        (`kept_input(name)` is what the checkpoint keeps of each), its outputs into `env`."""
        inside = {node.name for node in run}
        needed = sorted({source.name for node in run for source in node.all_input_nodes
                         if source.name not in inside and isinstance(env.get(source.name), torch.Tensor)})
        produced = [node.name for node in run]

        def body(*tensors, _env=dict(env)):
            local = {**_env, **dict(zip(needed, tensors))}
            self.interpreter.run_nodes(run, local)
            return tuple(local[name] for name in produced)

        kept = [kept_input(name) for name in needed]
        env.update(zip(produced, checkpoint(body, *kept, use_reentrant=False, **checkpoint_kwargs)))

    def _shard_before_checkpoint(self, run: list[torch.fx.Node], name: str, env: dict) -> torch.Tensor:
        """The input a recomputed run keeps: sharded first where every op of the run wants it
        sharded (a row-parallel output reduce-scattered onto the sequence keeps 1/tp of it, as
        Korthikanti et al.'s sequence parallelism does; the cost model prices the same)."""
        value = env[name]
        if not self.interpreter.distributed or not isinstance(value, DTensor):
            return value
        wanted = {placement for node in run for source, placement in self.interpreter.wanted_inputs(node, env)
                  if source == name}
        if len(wanted) != 1:
            return value
        placement = wanted.pop()
        if placement is None or not placement.startswith("S") or value.placements[0].is_shard():
            return value
        return self.interpreter.place(value, placement)


def _runs(nodes: list[torch.fx.Node], recomputable: set[str]) -> list[tuple[list[torch.fx.Node], bool]]:
    runs: list[tuple[list[torch.fx.Node], bool]] = []
    for node in nodes:
        flag = node.name in recomputable
        if runs and runs[-1][1] == flag:
            runs[-1][0].append(node)
        else:
            runs.append(([node], flag))
    return runs


class StageProgram(ParameterOwner):
    """The segments of one pipeline stage (all of them when pp = 1).

    Inputs arrive as plain tensors: user inputs (the same on every tensor-parallel rank) are
    placed as the plan says; boundary tensors from the previous stage are this rank's local
    shards. Outputs leave as DTensors (whole model), local shards (to the next stage) or
    replicated local tensors (the model output, for the loss; its local shards for a class-sharded loss).
    """

    def __init__(self, segments: list[SegmentModule], interpreter: PlannedInterpreter, *, inputs: list[str],
                 boundary_inputs: set[str], outputs: list[str], output_mode: str, placements: dict[str, str],
                 scalars: set[str] = frozenset(), wires: dict[str, str] | None = None) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.interpreter = interpreter
        self.input_names = inputs
        self.boundary_inputs = boundary_inputs
        self.output_names = outputs
        self.output_mode = output_mode
        self.owned_outputs = False
        """Outputs must not be views: torch's split backward (zero-bubble schedules) detaches
        them in place, which a view (a DTensor's local shard) refuses."""
        self.placements = placements
        self.wires = wires or {}
        """Boundary tensors that travel as another placement than planned: a replicated activation
        as each tp rank's slice, all-gathered on arrival (Megatron-LM's scatter/gather)."""
        self.scalars = scalars
        """Python numbers (symbolic sizes) that cross a pipeline boundary as 0-dim tensors."""
        self.fixed_values: dict[str, torch.Tensor] = {}
        """Buffers and constants of the exported program, by placeholder."""

    def forward(self, *inputs):
        env: dict = dict(self.fixed_values)
        for name, value in zip(self.input_names, inputs):
            env[name] = self._enter(name, value)
        env.update(self._params())
        for segment in self.segments:
            env.update(segment({name: env[name] for name in segment.input_names if name in env}))
        outputs = tuple(self._leave(name, env[name]) for name in self.output_names)
        return outputs[0] if len(outputs) == 1 else outputs

    def _enter(self, name: str, value):
        if name in self.scalars and isinstance(value, torch.Tensor):
            return value.item()
        value = self.in_compute_dtype(value)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        placement = self.placements.get(name, "R")
        if name in self.boundary_inputs:
            value = contiguous_grad(value)  # its gradient is sent back to the previous stage
        if name in self.boundary_inputs and self.interpreter.distributed:
            wire = self.wires.get(name, placement)
            value = DTensor.from_local(value, self.interpreter.mesh, [to_dtensor_placement(wire)], run_check=False)
            return value if wire == placement else self.interpreter.place(value, placement)
        return self.interpreter.place(value, placement)

    def _leave(self, name: str, value):
        if name in self.scalars and self.output_mode != "dtensor":
            return torch.tensor(value)
        if self.output_mode == "dtensor":
            return value
        wire = self.wires.get(name) if self.output_mode == "local" and self.interpreter.distributed else None
        if wire is not None and isinstance(value, torch.Tensor):  # this rank's slice of a replicated activation
            value = self.interpreter.as_dtensor(value).redistribute(self.interpreter.mesh, [to_dtensor_placement(wire)])
        if isinstance(value, DTensor) and self.output_mode == "replicated":
            value = contiguous_grad(value).redistribute(self.interpreter.mesh, [Replicate()]).to_local()
        elif isinstance(value, DTensor):
            value = value.to_local()
        # Pipeline stages send what leaves them (isend takes contiguous tensors only): a transpose
        # or a slice that ends a stage is copied here.
        if not isinstance(value, torch.Tensor):
            return value
        value = value.contiguous()
        if self.output_mode == "local":  # sent in the compute dtype, as the pipeline's buffers expect
            value = self.in_compute_dtype(value)
        return value.clone() if self.owned_outputs and value._is_view() else value


def distribute_parameter(param: torch.Tensor, placement: str, mesh, device: torch.device) -> nn.Parameter:
    """A parameter as a DTensor with the plan's tensor-parallel placement (sliced locally); a
    meta parameter gets empty (NaN) storage for this rank's shard only, filled by codegen/init."""
    if param.device.type == "meta":
        from autopar.codegen.init import empty_shard

        distributed = mesh.size() > 1
        placements = [to_dtensor_placement(placement if placement not in ("R", "P") else "R")]
        shard = empty_shard(param.detach(), placements, mesh if distributed else None, device)
        return nn.Parameter(shard, requires_grad=param.requires_grad)
    data = param.detach().to(device)
    if mesh.size() == 1:  # no tensor parallelism: a plain parameter
        return nn.Parameter(data.clone(), requires_grad=param.requires_grad)
    if placement not in ("R", "P"):
        local = distribute_tensor(data, mesh, [to_dtensor_placement(placement)], src_data_rank=None).to_local()
        tensor = DTensor.from_local(local.clone(), mesh, [to_dtensor_placement(placement)], run_check=False)
    else:
        tensor = DTensor.from_local(data.clone(), mesh, [Replicate()], run_check=False)
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


def shared_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters that belong to several of `modules` (one rank's pipeline chunks reading one
    tied weight: ZB-V's embedding and head on its first rank, T5's three readers interleaved), once each."""
    seen: dict[int, nn.Parameter] = {}
    shared: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in {id(param): param for param in module.parameters()}.values():
            if id(param) in seen:
                shared[id(param)] = param
            seen[id(param)] = param
    return list(shared.values())


def recomputable_nodes(graph: OpGraph) -> set[str]:
    return {node.name for node in graph.calls() if is_recomputable(graph, node)}

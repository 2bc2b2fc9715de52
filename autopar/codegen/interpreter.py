"""Runs nodes of an exported graph on DTensors, redistributing where the plan says.

Every tensor lives on the tensor-parallel mesh. Before an op runs, each tensor input is
redistributed to the placement the plan chose for that op's input (once per producer and
placement: the same redistributed tensor serves every consumer asking for it, as the ILP
priced). After the op, DTensor's own output placement is checked against the plan's; a
difference is redistributed away and counted (`mismatches`), so the collectives that run are
those the plan priced. Autograd runs the backward through the same DTensor ops, and each
output's gradient is moved to the placement the plan priced for it (`pin_grad`) before it
reaches its producer. Ops whose placed inputs make them purely local (no collective, DTensor's
output as planned) run on the local tensors instead, without DTensor's dispatch
(codegen/local_runs.py), as PyTorch's own tensor parallelism runs attention and activations.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.node import map_aggregate

from autopar.codegen.all_to_all import runs_own_all_to_all, shard_to_shard
from autopar.codegen.experts import Dispatched
from autopar.codegen.local_runs import LocalRuns
from autopar.codegen.local_ops import has_local_rule, no_dtensor_strategy, run_replicated, run_sharded
from autopar.codegen.placements import current, parse_node_placements, same_placement, to_dtensor_placement
from autopar.codegen.random_ops import draws, global_draws, run_random
from autopar.strategies.grouped_mm import EXPERT_BIAS_TARGETS
from autopar.strategies.placement import grad_placement


@dataclass
class RunStats:
    """What the interpreter did differently from the plan (for reports and tests)."""

    mismatches: Counter = field(default_factory=Counter)
    """Ops whose DTensor output placement differed from the plan's, by target."""
    details: list = field(default_factory=list)
    """(node, planned output, DTensor's output) for each mismatch."""
    replicated: Counter = field(default_factory=Counter)
    """Ops DTensor has no strategy for, run replicated on whole tensors, by target."""
    kept: Counter = field(default_factory=Counter)
    """Forward tensors saved for backward by a recomputation mode's own rule (codegen/recompute.py):
    "op" for the selective policy's MUST_SAVE, "regathered" for gathered saves kept as shards."""
    fused_wgrad: Counter = field(default_factory=Counter)
    """Weight gradients accumulated into the fp32 .grad by codegen/fused_wgrad.py: "fused" inside the
    GEMM, "fallback" as DTensors (a gradient placed otherwise than planned)."""
    async_tp: Counter = field(default_factory=Counter)
    """Sequence-parallel linears run by codegen/async_tp.py: "column" (all-gather fused with the GEMM),
    "row" (GEMM fused with the reduce-scatter), "shared" (a gathered input reused), "fallback" (DTensor's path)."""
    local: Counter = field(default_factory=Counter)
    """Ops run on local tensors, their placed inputs making them purely local (codegen/local_runs.py), by target."""
    random_gathered: Counter = field(default_factory=Counter)
    """Random ops run whole on gathered inputs so that every tp rank draws one process's numbers
    (codegen/random_ops.py: attention with dropout, bernoulli of probabilities...), by target."""
    expert_rows: dict = field(default_factory=dict)
    """Dropless expert layers (grouped matmuls) run expert-parallel: {first op's node: [rows this
    rank received, rows it sent]}, summed over every dispatch (ParallelModule.expert_load)."""


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    DTensor's reshape of a non-contiguous gradient can fail ("view size is not compatible") where
    a plain tensor's would copy: the backward of a view op (q/k/v split from a fused projection,
    then transposed for attention) and of an all-gather on dim d > 0 (whose backward slices the
    gradient into non-contiguous shards) get contiguous gradients."""

    @staticmethod
    def forward(ctx, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grad_mode_kept(target):
    """Restores grad mode after a higher-order op: torch's wrap_with_set_grad_enabled (a
    `with torch.no_grad():` region) leaves grad off when its body raises (an op DTensor has no
    strategy for, which then runs replicated), and every later op would run without autograd."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return torch.set_grad_enabled(torch.is_grad_enabled())
    return contextlib.nullcontext()


def contiguous_grad(value):
    """`value`, whose gradient will be made contiguous: a plain tensor's, or a DTensor's when it is
    sharded on a dim > 0 (and it needs a gradient)."""
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        return value
    if not isinstance(value, DTensor) or any(isinstance(p, Shard) and p.dim > 0 for p in value.placements):
        return _ContiguousGrad.apply(value)
    return value


def _where(node: torch.fx.Node, env: dict[str, Any], planned) -> str:
    """The failing node, its inputs as the interpreter held them and the model's line that made it
    (the note a failure carries: an op error alone names neither)."""
    def describe(arg):
        value = env.get(arg.name) if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, DTensor):
            return (f"{arg.name}: {tuple(value.shape)} {value.placements[0]} stride {value.stride()} (local "
                    f"{tuple(value._local_tensor.shape)} stride {value._local_tensor.stride()})")
        if isinstance(value, torch.Tensor):
            return f"{arg.name}: {tuple(value.shape)} stride {value.stride()}"
        return repr(arg)

    inputs = ", ".join(describe(arg) for arg in node.args if not isinstance(arg, (list, tuple)))
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
              if line.strip().startswith("File ") and "/torch/" not in line]
    return (f"autopar: while running {node.name} = {node.target}({inputs}), planned (output, inputs) {planned}"
            + (f", {frames[-1]}" if frames else ""))


def _hint(value) -> int:
    """A stride's value (a symbolic one's hint; 0 for one without: at worst a needless copy)."""
    return (value.node.hint or 0) if isinstance(value, torch.SymInt) else int(value)


@functools.cache
def _aliases_an_input(target) -> bool:
    """Whether an op's output may be a view of an input (a copy of it would no longer alias)."""
    schema = getattr(target, "_schema", None)
    return schema is None or any(value.alias_info is not None for value in schema.returns)


def _dim_order(strides) -> list[int]:
    """The dims of a layout from outermost to innermost (ties in their order)."""
    return sorted(range(len(strides)), key=lambda dim: -_hint(strides[dim]))


def _same_order(strides, other_strides, sizes) -> bool:
    """Whether two layouts of a shape order its dims alike (dims of size 1 have no place in memory)."""
    def order(values):
        return [dim for dim in _dim_order(values) if _hint(sizes[dim]) > 1]

    return order(strides) == order(other_strides)


def _relaid(value: torch.Tensor, order: list[int]) -> torch.Tensor:
    """`value` copied so that its dims lie in memory in `order` (outermost first)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return value.permute(order).contiguous().permute(inverse)


def captured_layout(result, captured):
    """`result` laid out in memory as the captured op's output was (`captured`, its fake value).

    A kernel run in place of the captured one can compute the same values in another layout: CPU's
    flash attention (which export records) returns its output as (batch, sequence, heads, dim) in
    memory, the math kernel `_cpu_attention` runs under DTensor as (batch, heads, sequence, dim). A
    later `view` that export recorded on the captured layout (AFMoE's `output.transpose(1, 2)
    .view(batch, sequence, -1)`, with no `.contiguous()` between since export saw none needed) then
    fails on the other one ("Cannot view a tensor ..."). The result is copied into the captured dim
    order (values and placements unchanged)."""
    if not isinstance(result, torch.Tensor) or not isinstance(captured, torch.Tensor) or result.dim() != captured.dim():
        return result
    if _same_order(result.stride(), captured.stride(), result.shape):
        return result
    return _relaid(result, _dim_order(captured.stride()))


def local_as_described(value: DTensor) -> DTensor:
    """`value` with its local tensor laid out as its DTensor spec says.

    A redistribution allocates a new local tensor (an all-gather's, contiguous) but keeps the
    spec's global strides: a transposed tensor gathered from Shard(1) to Replicate is described as
    transposed and held contiguous. DTensor decides later views on the description and runs them on
    the local tensor (LFM2-MoE's short convolution: `in_proj(x).transpose(-1, -2).chunk(3, -2)`
    gathered, multiplied, transposed back and fed to a linear, whose view of the local input failed
    with "view size is not compatible"). Some ops' rules describe their output (forward or
    gradient) as contiguous where the local kernel, following its inputs' layout, stored it
    otherwise (Doge: softplus's gradient, stored transposed, reached a linear's backward described
    contiguous). The local tensor is copied into the described dim order."""
    local = value._local_tensor
    if (local.is_contiguous() and value.is_contiguous()) or _same_order(local.stride(), value.stride(), local.shape):
        return value  # the first test (two C++ calls) answers for almost every tensor of a step
    return DTensor.from_local(_relaid(value.to_local(), _dim_order(value.stride())), value.device_mesh,
                              value.placements, shape=value.shape, stride=value.stride(), run_check=False)


def redistribute(value: DTensor, placement: str) -> DTensor:
    """`value` on its one-axis mesh with the plan's `placement` (not "P"), by the collective the
    planner priced: DTensor's redistribution, or an all-to-all where DTensor would all-gather a
    shard-dim change instead (codegen/all_to_all.py)."""
    target = to_dtensor_placement(placement)
    if runs_own_all_to_all(value, target):
        return local_as_described(shard_to_shard(contiguous_grad(value), target.dim))
    return local_as_described(contiguous_grad(value).redistribute(value.device_mesh, [target]))


def _pinned(grad, placement: str):
    """`grad` (summed over every reader) redistributed to `placement`."""
    if isinstance(grad, DTensor) and not same_placement(grad.placements[0], placement):
        return redistribute(grad, placement)
    if isinstance(grad, DTensor):  # DTensor's backward rules too describe some gradients otherwise than held
        return local_as_described(grad)
    return grad


class _PinnedGrad(torch.autograd.Function):
    """Identity whose backward pins the gradient (`_pinned`): for tensors a hook cannot serve."""

    @staticmethod
    def forward(ctx, value, placement: str):
        ctx.placement = placement
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return _pinned(grad, ctx.placement), None


def pin_grad(value, placement: str):
    """`value`, whose gradient reaches its producer as `placement` (the plan's grad_placement of
    its output: a partial output's gradient replicated, any other as the output).

    DTensor's backward rules leave a gradient as they find it cheapest locally, and autograd sums
    a tensor's gradients from its readers as they come: the gradient of a replicated activation
    read by column-parallel matmuls stays Partial, and DTensor carries those pending sums on
    through linear backward ops (an RMS norm's, a residual add's, the next matmul's) until some
    rule needs them whole, so the all-reduce runs elsewhere, or becomes reduce-scatters of weight
    gradients and all-gathers inside matmul backwards. The planner priced each edge's backward as
    its reader's gradient moved to this placement (solver/sharding_problem.py's edge_events; a
    fan-out's readers summed first, one collective), and that is where it runs."""
    if not isinstance(value, DTensor) or not value.requires_grad:
        return value
    if value.grad_fn is None or hasattr(value, "_autopar_pinned"):
        # A leaf's hook would change its .grad; a tensor pinned already (an op that returned its
        # input) would run both hooks on one gradient: an identity node serves these.
        return _PinnedGrad.apply(value, placement)
    # A hook on the producer's output (autograd runs it on the gradient summed over every reader)
    # costs no DTensor op in the forward and no autograd node. An identity Function on every output
    # (a DTensor view_as and a Python backward each, ~120 per step) cost ~4% of a step in
    # benchmarks/runtime_overhead.py's tp2 x dp2 (CPU, ZeRO-3): +15% -> +11% over the hand-written step.
    value._autopar_pinned = placement
    value.register_hook(functools.partial(_pinned, placement=placement))
    return value


@functools.cache  # asked for every op of every step; the graph does not change
def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether a reader of `node`'s output, or of an item or a view of it, writes to it in place
    (Hugging Face's MoE routers divide top-k weights in place; `index_put_` into an empty tensor):
    such an output keeps DTensor's own gradient."""
    for reader in node.users:
        if reader.target is operator.getitem or getattr(reader.target, "is_view", False):
            if _written_in_place(reader):
                return True
            continue
        schema = getattr(reader.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        passed = list(zip(schema.arguments, reader.args)) + \
            [(argument, reader.kwargs[argument.name]) for argument in schema.arguments if argument.name in reader.kwargs]
        if any(value is node and argument.alias_info is not None and argument.alias_info.is_write
               for argument, value in passed):
            return True
    return False


def _map_tensors(result, fn):
    if isinstance(result, (list, tuple)):
        return type(result)(fn(item) for item in result)
    return fn(result)


def _has_dtensor(args, kwargs) -> bool:
    found = []
    map_aggregate((args, kwargs), lambda value: found.append(value) if isinstance(value, DTensor) else None)
    return bool(found)


def _special_partial(placement) -> bool:
    return isinstance(placement, Partial) and type(placement) is not Partial


class PlannedInterpreter:
    def __init__(self, placements: dict[str, str], mesh, stats: RunStats | None = None):
        self.placements = {name: parse_node_placements(text) for name, text in placements.items()}
        self.mesh = mesh
        self.stats = stats or RunStats()
        self.distributed = mesh.size() > 1
        """Without tensor parallelism ops run on plain tensors (DTensor dispatch costs ~20% on CPU)."""
        self.replicated_targets: set = set()
        """Targets found to have no DTensor strategy (run replicated from then on)."""
        self.overrides: dict = {}
        """target -> fn(node, args, kwargs) run instead of the op (context parallelism's position-aware ops)."""
        self.experts = None
        """ExpertRunner (codegen/experts.py) of an expert-parallel plan, else None."""
        self.folded = None
        """FoldedRegions (codegen/expert_folding.py) of a plan that folds its experts (etp=1), else None."""
        self.current_node: str | None = None
        """The node whose op is running (not while its inputs are redistributed): the "op"
        recomputation policy keeps what kept nodes produce (codegen/recompute.py)."""
        self.on_gather = None
        """Called with (shard, gathered) after each all-gather of an input (compact_saves)."""
        self.recomputed_activations: frozenset[str] = frozenset()
        """Gated activations whose output the product's backward runs again (activation_saves.py)."""
        self.on_activation = None
        """Called with (node, args, kwargs, output) after each of those runs (compact_saves)."""
        self.fused_wgrad = None
        """FusedWgrad (codegen/fused_wgrad.py) of a bf16 plan: linears on step copies accumulate
        their weight gradients into the fp32 .grad inside the GEMM; None: autograd's path."""
        self.async_tp = None
        """AsyncTP (codegen/async_tp.py) of a sequence-parallel plan run with async TP: linears fuse
        their all-gather / reduce-scatter into the GEMM; None: DTensor's collectives."""
        self.parameter_inputs: frozenset[str] | None = None
        """Placeholders that are parameters (None: unknown, every placeholder counts as one)."""
        self.local_runs = LocalRuns(self) if self.distributed else None
        """Ops the plan makes purely local, run on local tensors where run_nodes allows (local_runs.py)."""

    def as_dtensor(self, value: torch.Tensor) -> DTensor:
        """Plain tensors (factory outputs, buffers) are the same on every rank: replicated."""
        if isinstance(value, DTensor) or not self.distributed:
            return value
        return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)

    def place(self, value: torch.Tensor, placement: str) -> DTensor:
        if not self.distributed:
            return value
        value = self.as_dtensor(value)
        # DTensor refuses a user redistribution to Partial ("internal use only"): the op's own rule
        # makes that operand Partial (a row-parallel linear's replicated bias becomes bias / n).
        if same_placement(value.placements[0], placement) or placement == "P":
            return value
        result = redistribute(value, placement)
        if self.on_gather is not None and value.placements[0].is_shard() and placement == "R":
            self.on_gather(value, result)
        return result

    def wanted_inputs(self, node: torch.fx.Node, env: dict[str, Any]) -> list[tuple[str, str | None]]:
        """(producer, planned placement) of each tensor input of `node`, in `_call`'s order."""
        _, input_placements = self.placements.get(node.name, (None, []))
        found: list[tuple[str, str | None]] = []

        def visit(arg):
            if isinstance(arg, torch.fx.Node) and isinstance(env.get(arg.name), torch.Tensor):
                position = len(found)
                found.append((arg.name, input_placements[position] if position < len(input_placements) else None))
            return arg

        map_aggregate(node.args, visit)
        map_aggregate(dict(node.kwargs), visit)
        return found

    def run_nodes(self, nodes: list[torch.fx.Node], env: dict[str, Any], *, local: bool = False) -> None:
        """Execute `nodes`, reading inputs from and writing outputs into `env`. `local`: ops the
        plan makes purely local may run on local tensors (codegen/local_runs.py); what is read
        after `nodes` leaves them as DTensors."""
        cache: dict[tuple[str, str], DTensor] = {}
        runs = self.local_runs if local and self._local_runs_apply() else None
        for node in nodes:
            if node.op != "call_function":
                continue
            try:
                if runs is None:
                    env[node.name] = self._call(node, env, cache)
                    continue
                result = runs.try_run(node, env, cache)
                if result is None:
                    for source in node.all_input_nodes:
                        runs.materialize(source.name, env, cache)
                    mismatches = len(self.stats.details)
                    result = self._call(node, env, cache)
                    if runs.wants_check(node):
                        runs.verify(node, env, cache, result, planned=len(self.stats.details) == mismatches)
                env[node.name] = result
            except Exception as error:
                error.add_note(_where(node, env, self.placements.get(node.name)))
                raise
        if runs is not None:
            for name in runs.read_outside(nodes):
                runs.materialize(name, env, cache)

    @staticmethod
    def written_in_place(node: torch.fx.Node) -> bool:
        return _written_in_place(node)

    def _local_runs_apply(self) -> bool:
        """Local runs serve plain tensor-parallel plans; the runners that read the interpreter's
        values themselves (experts, folded experts, async TP, context parallelism's overrides)
        and the "gathers" mode's saved-tensor hooks see DTensors only."""
        return self.local_runs is not None and self.distributed and self.experts is None and self.folded is None \
            and self.async_tp is None and not self.overrides and self.on_gather is None

    def _call(self, node: torch.fx.Node, env: dict[str, Any], cache: dict) -> Any:
        if self.folded is not None and node.name in self.folded.nodes:
            return self.folded.run(node.name, env, self.place)
        output_placement, input_placements = self.placements.get(node.name, (None, []))
        if self.experts is not None and node.name in self.experts.ops:
            return self._expert_call(node, env, cache, output_placement, input_placements)
        if self.experts is not None and node.name in self.experts.views:
            return self.experts.run_view(node, env)
        if self.experts is not None and node.name in self.experts.between:
            # A row-local op between two chained expert ops: as planned, on the rows dispatched
            # to this rank's experts; its result stays dispatched (codegen/experts.py).
            if str(node.target) in EXPERT_BIAS_TARGETS:
                return self.experts.run_bias(node, env)
            inputs, dispatched = self.experts.unwrap(node, env)
            return dispatched.wrap(self._planned_call(node, inputs, cache, output_placement, input_placements))
        return self._planned_call(node, env, cache, output_placement, input_placements)

    def _planned_call(self, node: torch.fx.Node, env: dict[str, Any], cache: dict, output_placement,
                      input_placements: list[str]) -> Any:
        if self.async_tp is not None and self.distributed:
            self.current_node = node.name
            try:
                fused = self.async_tp.run(node, self, env, cache, output_placement, input_placements)
            finally:
                self.current_node = None
            if fused is not None:  # placed as its readers want: no check, its gradient pinned so
                return pin_grad(fused, current(fused))
        position = 0

        def load(arg):
            nonlocal position
            if not isinstance(arg, torch.fx.Node):
                return arg
            if arg.op == "get_attr" and arg.name not in env:  # a higher-order op's body (a no_grad region)
                return operator.attrgetter(arg.target)(arg.graph.owning_module)
            value = env[arg.name]
            if not isinstance(value, torch.Tensor):
                return value
            wanted = input_placements[position] if position < len(input_placements) else None
            position += 1
            if wanted is None:
                return self.as_dtensor(value)
            key = (arg.name, wanted)
            if key not in cache:
                cache[key] = self.place(value, wanted)
            return cache[key]

        args = map_aggregate(node.args, load)
        kwargs = map_aggregate(dict(node.kwargs), load)
        self.current_node = node.name
        try:
            result = self._run_op(node, args, kwargs, output_placement)
        finally:
            self.current_node = None
        if self.distributed and not _aliases_an_input(node.target):
            result = _map_tensors(result, lambda value: local_as_described(value) if isinstance(value, DTensor) else value)
        if output_placement is not None and node.target is not operator.getitem and self.distributed:
            result = self._check_output(node, result, output_placement)
            if not _written_in_place(node):  # autograd forbids in-place writes to a custom Function's view
                result = _map_tensors(result, lambda value: pin_grad(value, grad_placement(output_placement)))
        if self.on_activation is not None and node.name in self.recomputed_activations:
            self.on_activation(node, args, kwargs, result)
        return result

    def _run_op(self, node: torch.fx.Node, args, kwargs, output_placement):
        if node.target in self.overrides:
            result = self.overrides[node.target](node, args, kwargs)
        elif node.target is _SDPA and isinstance(args[0], DTensor) and args[0].device.type == "cpu":
            with global_draws(self.mesh) if draws(node.target, args, kwargs) else contextlib.nullcontext():
                result = captured_layout(self._cpu_attention(*args, **kwargs), node.meta.get("val"))
        elif self.distributed and draws(node.target, args, kwargs) and _has_dtensor(args, kwargs):
            result = run_random(node.target, args, kwargs, self.mesh, output_placement, self.stats)
        elif self.distributed and has_local_rule(node.target):
            result = run_sharded(node.target, args, kwargs, self.mesh, output_placement or "R")
        elif self.distributed and node.target in self.replicated_targets:
            result = run_replicated(node.target, args, kwargs, self.mesh)
        elif self.fused_wgrad is not None and not kwargs and \
                (weight := self.fused_wgrad.master(node.target, args, output_placement)) is not None:
            result = self.fused_wgrad.linear(weight, *args)
        else:
            try:
                with _grad_mode_kept(node.target):
                    result = node.target(*args, **kwargs)
            except NotImplementedError as error:
                if not self.distributed or not no_dtensor_strategy(error):
                    raise
                # An op DTensor has no strategy for runs replicated, as the plan priced an op
                # without a rule (the error is raised before any compute or communication).
                self.replicated_targets.add(node.target)
                self.stats.replicated[str(node.target)] += 1
                result = run_replicated(node.target, args, kwargs, self.mesh)
        if node.target in _RESHAPES and isinstance(result, DTensor) and result.requires_grad:
            result = _ContiguousGrad.apply(result)
        return result

    def _expert_call(self, node: torch.fx.Node, env: dict[str, Any], cache: dict, output_placement,
                     input_placements: list[str]) -> Any:
        """An expert op of an expert-parallel plan: the weight is taken as stored (on the (tp, ep)
        mesh), the tokens placed as planned, and codegen/experts.py exchanges them."""
        op = self.experts.ops[node.name]
        position = 0

        def load(arg):
            nonlocal position
            if not isinstance(arg, torch.fx.Node) or not isinstance(env[arg.name], (torch.Tensor, Dispatched)):
                return env[arg.name] if isinstance(arg, torch.fx.Node) else arg
            index, position = position, position + 1
            value = env[arg.name]
            wanted = input_placements[index] if index < len(input_placements) else None
            if index == op.weight_input or not self.distributed or wanted is None:
                return value
            key = (arg.name, wanted)
            if key not in cache:
                cache[key] = value.wrap(self.place(value.value, wanted)) if isinstance(value, Dispatched) \
                    else self.place(value, wanted)
            return cache[key]

        args = map_aggregate(node.args, load)
        kwargs = map_aggregate(dict(node.kwargs), load)
        placements = list(input_placements) + ["R"] * 2
        partial_grad = placements[op.token_input] == "R" and placements[op.weight_input] != "R"
        return self.experts.run(node, args, kwargs, self.mesh if self.distributed else None, output_placement,
                                partial_grad)

    def _cpu_attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
        """DTensor has no rule for the CPU flash kernel: run the math kernel with an explicit
        causal mask (DTensor cannot build the implicit one). The flash kernel reads any strides;
        the math kernel's batched matmuls view (batch, heads) as one dim, which keys and values
        broadcast over heads (stride 0: RecurrentGemma's one kv head expanded to every query head)
        cannot be: those are copied contiguous first."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        query, key, value = (tensor.contiguous() for tensor in (query, key, value))

        if is_causal:
            rows, columns = query.shape[-2], key.shape[-2]
            mask = torch.ones(rows, columns, dtype=torch.bool, device=query.device).tril()
            attn_mask, is_causal = self.as_dtensor(mask), False
        with sdpa_kernel(SDPBackend.MATH):
            return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    def _check_output(self, node: torch.fx.Node, result: Any, placement: str) -> Any:
        def fix(value):
            if isinstance(value, DTensor) and _special_partial(value.placements[0]):
                # A vocab-parallel embedding's masked partial: DTensor reduces it before any other
                # op anyway; reduce it here, where the plan's later P -> R all-reduce would be.
                value = value.redistribute(self.mesh, [Replicate()])
                if placement == "P":
                    return value
            if isinstance(value, DTensor) and not same_placement(value.placements[0], placement):
                self.stats.mismatches[str(node.target)] += 1
                self.stats.details.append((node.name, placement, str(value.placements[0])))
                if placement == "P":  # DTensor allows no user redistribution to Partial
                    return value
                return redistribute(value, placement)
            return value

        if isinstance(result, (list, tuple)):
            return type(result)(fix(item) for item in result)
        return fix(result)

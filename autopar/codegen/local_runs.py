"""Ops whose placed inputs make them purely local, run on this rank's local tensors.

A tensor-parallel plan places each op's inputs so that the op itself communicates nothing: the
collectives run on the edges (redistributions), the op on each rank's part. DTensor still
dispatches every op of the step in Python (sharding propagation, unwrap, wrap) and again for
each op of its backward, which costs about as much as a small op's kernel on a CPU. PyTorch's
own tensor parallelism keeps most of a layer on plain tensors: `ColwiseParallel` returns the
local shard of its output (`use_local_output`), attention and the activation run on it, and
`RowwiseParallel` wraps it again (`from_local`) for its matmul (torch.distributed.tensor.parallel).

Here the same is done from the plan: an op runs on local tensors when all its tensor inputs and
its output are replicated (every rank computes the whole op), or when its output and inputs are
shards and the op is one whose local run computes its output's shard (pointwise ops, views whose
size arguments are rewritten to the local sizes, softmax along a dim left whole, matmuls sharded
on a batch dim). Replicated inputs of a sharded op must not need a gradient (the causal mask):
their gradient would be a partial sum on each rank. A value leaves the local run (`from_local`)
where a DTensor op or another segment reads it; its gradient arrives at the producer in the
value's own placement, the plan's `grad_placement` for R and S outputs.

Each node runs through DTensor the first time, and is run locally from then on only if DTensor's
output had the plan's placement and the local run gives the same local tensor (the check costs
one extra op per node, once). The check is each rank's own: the ops it admits compute their
shard the same way on every rank, so the ranks agree; an op whose local run were right on some
ranks only (one reading global positions along the sharded dim) must not be admitted, as the ranks
would then take different paths and their backward redistributions differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.fx.node import map_aggregate

from autopar.codegen.placements import current, to_dtensor_placement
from autopar.codegen.random_ops import draws, is_random_target
from autopar.solver.dtensor_ops import MATMULS, PARAMETER_READERS, local_placement

aten = torch.ops.aten

_SIZED_VIEWS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1}
"""Views whose argument (at the given position) is the global output size."""
_SHARD_LOCAL = frozenset({
    aten.unflatten.int, aten.flatten.using_ints, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten._to_copy.default, aten.to.dtype, aten.dropout.default, aten.matmul.default, aten.bmm.default,
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    *_SIZED_VIEWS,
})
"""Ops (besides pointwise ones) whose local run on shards gives the output's shard, as the plan
places them (verified against DTensor on the first run)."""
_SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default})
"""Shard-local when the reduced dim is not the sharded one."""


@dataclass
class Local:
    """A node's output held as this rank's local tensor with its plan placement ("R" or "S<d>")."""

    value: torch.Tensor
    placement: str


def _shard_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


def _single_tensor_op(target) -> bool:
    schema = getattr(target, "_schema", None)
    if not isinstance(target, torch._ops.OpOverload) or schema is None or schema.is_mutable:
        return False
    return len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"


def _reads_parameters_locally(target, *, fused_wgrad: bool) -> bool:
    """Whether an op reading parameters may run on their local tensors: one computing each
    parameter's gradient afresh (a norm's scale and shift, an embedding table, a convolution, a
    replicated linear: solver/dtensor_ops.PARAMETER_READERS says why others may not), and not a
    matmul the weight-gradient fusion runs (`fused_wgrad`: fused_wgrad.py; float8's linears are
    interpreter overrides, never local). The local tensor of a parameter (or its step copy) passes
    its gradient back in the parameter's own placement, so FSDP2 and the casts see it as from a
    DTensor op."""
    name = str(target)
    return name in PARAMETER_READERS and not (fused_wgrad and name in MATMULS)


def _may_draw(node: torch.fx.Node) -> bool:
    """Whether a random op may draw (by its static arguments; a computed one counts as drawing)."""
    try:
        return draws(node.target, tuple(node.args), dict(node.kwargs))
    except (TypeError, ValueError):
        return True


class LocalRuns:
    """Which nodes of a plan run on local tensors, and running them (PlannedInterpreter's helper)."""

    def __init__(self, interpreter) -> None:
        self.interpreter = interpreter
        self.size = interpreter.mesh.size()
        self.verified: dict[str, bool] = {}
        """Node -> whether its local run matched DTensor's on its first run."""
        self._static: dict[str, bool] = {}
        self._outside: dict[tuple, frozenset[str]] = {}

    # --- which nodes ----------------------------------------------------------------------------

    def _eligible(self, node: torch.fx.Node) -> bool:
        if node.name not in self._static:
            self._static[node.name] = self._eligible_uncached(node)
        return self._static[node.name]

    def _eligible_uncached(self, node: torch.fx.Node) -> bool:
        interpreter = self.interpreter
        target = node.target
        if not _single_tensor_op(target) or target in interpreter.overrides or target in interpreter.replicated_targets:
            return False
        if target is aten.scaled_dot_product_attention.default or node.name in interpreter.recomputed_activations:
            return False
        if is_random_target(target) and _may_draw(node):
            return False  # drawn as one process would (random_ops.py); the first run's check would draw too
        if interpreter.written_in_place(node):
            return False  # autograd's view and in-place tracking would cross from_local / to_local
        parameters = interpreter.parameter_inputs
        if any(source.op == "placeholder" and (parameters is None or source.name in parameters)
               for source in node.all_input_nodes) and \
                not _reads_parameters_locally(target, fused_wgrad=interpreter.fused_wgrad is not None):
            return False  # only ops computing a parameter's gradient afresh read it locally
        if any(source.name in interpreter.recomputed_activations for source in node.all_input_nodes):
            return False  # a gated activation's output is saved as its recipe when its reader saves the DTensor
        planned = interpreter.placements.get(node.name)
        if planned is None:
            return False
        output, inputs = planned
        if not local_placement(output) or not all(local_placement(item) for item in inputs):
            return False
        if output == "R":
            return all(item == "R" for item in inputs)
        return (torch.Tag.pointwise in target.tags or target in _SHARD_LOCAL or target in _SOFTMAX) \
            and any(item.startswith("S") for item in inputs)

    # --- running ----------------------------------------------------------------------------------

    def try_run(self, node: torch.fx.Node, env: dict, cache: dict):
        """The node's output as a `Local`, or None where it runs through DTensor (the first run,
        or inputs not placed as planned)."""
        if not self._eligible(node) or self.verified.get(node.name) is False:
            return None
        if node.name not in self.verified:
            return None  # PlannedInterpreter runs it through DTensor, then calls `verify`
        output_placement, input_placements = self.interpreter.placements[node.name]
        args = self._local_inputs(node, env, cache, input_placements, output_placement)
        if args is None:
            return None
        local_args, local_kwargs = args
        if draws(node.target, local_args, local_kwargs):
            return None
        self.interpreter.current_node = node.name
        try:
            result = node.target(*local_args, **local_kwargs)
        finally:
            self.interpreter.current_node = None
        self.interpreter.stats.local[str(node.target)] += 1
        return Local(result, output_placement)

    def _local_inputs(self, node, env: dict, cache: dict, input_placements: list[str], output_placement: str):
        position = 0
        refused = []

        def load(arg):
            nonlocal position
            if not isinstance(arg, torch.fx.Node):
                return arg
            value = env[arg.name]
            if not isinstance(value, (torch.Tensor, Local)):
                return value
            wanted = input_placements[position] if position < len(input_placements) else None
            position += 1
            local = self._local_value(arg.name, value, wanted, cache)
            if local is None or (wanted != "R" and output_placement == "R") or \
                    (wanted == "R" and output_placement != "R" and local.requires_grad):
                refused.append(arg.name)  # a replicated input of a sharded op: its gradient would be partial
                return None
            return local

        args = map_aggregate(node.args, load)
        kwargs = map_aggregate(dict(node.kwargs), load)
        if refused:
            return None
        return self._rewritten(node.target, args, output_placement, input_placements), kwargs

    def _local_value(self, name: str, value, wanted: str | None, cache: dict) -> torch.Tensor | None:
        if isinstance(value, Local):
            return value.value if value.placement == wanted else None
        if isinstance(value, DTensor):
            if wanted is None or current(value) != wanted or not self._even(value, wanted):
                return None
            key = (name, "local")
            if key not in cache:
                cache[key] = value.to_local()
            return cache[key]
        return value if wanted == "R" else None  # a plain tensor (factory output, buffer) is the same everywhere

    def _even(self, value: DTensor, placement: str) -> bool:
        dim = _shard_dim(placement)
        return dim is None or value.shape[dim] % self.size == 0

    def _rewritten(self, target, args: tuple, output_placement: str, input_placements: list[str]):
        """Size arguments of views changed from the global to the local output size."""
        dim = _shard_dim(output_placement)
        if dim is None:
            return args
        if target in _SIZED_VIEWS:
            position = _SIZED_VIEWS[target]
            sizes = list(args[position])
            if sizes[dim] != -1:
                sizes[dim] //= self.size
            return (*args[:position], sizes, *args[position + 1:])
        if target is aten.unflatten.int:
            source, first, sizes = args[0], args[1] % args[0].dim(), list(args[2])
            if first <= dim < first + len(sizes) and sizes[dim - first] != -1:
                sizes[dim - first] //= self.size
            return (source, args[1], sizes, *args[3:])
        return args

    # --- the first run ----------------------------------------------------------------------------

    def wants_check(self, node: torch.fx.Node) -> bool:
        return node.name not in self.verified and self._eligible(node)

    def verify(self, node: torch.fx.Node, env: dict, cache: dict, result, *, planned: bool) -> None:
        """After the node's first run through DTensor (`planned`: DTensor's output placement was
        the plan's): whether its local run gives the same."""
        self.verified[node.name] = planned and self._same_as_dtensor(node, env, cache, result)

    def _same_as_dtensor(self, node: torch.fx.Node, env: dict, cache: dict, result) -> bool:
        output_placement, input_placements = self.interpreter.placements[node.name]
        whole = output_placement == "R" and isinstance(result, torch.Tensor) and not isinstance(result, DTensor)
        if not whole and (not isinstance(result, DTensor) or current(result) != output_placement
                          or not self._even(result, output_placement)):
            return False
        position = 0
        missing = []

        def load(arg):  # the local tensors of the inputs the DTensor run read (the run's cache)
            nonlocal position
            if not isinstance(arg, torch.fx.Node) or not isinstance(env.get(arg.name), torch.Tensor):
                return env[arg.name] if isinstance(arg, torch.fx.Node) else arg
            wanted = input_placements[position] if position < len(input_placements) else None
            position += 1
            placed = cache.get((arg.name, wanted))
            if not isinstance(placed, DTensor) or current(placed) != wanted or not self._even(placed, wanted):
                missing.append(arg.name)
                return None
            return placed._local_tensor.detach()

        args = map_aggregate(node.args, load)
        kwargs = map_aggregate(dict(node.kwargs), load)
        if missing:
            return False
        args = self._rewritten(node.target, args, output_placement, input_placements)
        try:
            with torch.no_grad():
                local = node.target(*args, **kwargs)
        except RuntimeError:
            return False
        expected = result if whole else result._local_tensor
        return isinstance(local, torch.Tensor) and local.shape == expected.shape and local.dtype == expected.dtype \
            and torch.allclose(local, expected.detach(), rtol=1e-4, atol=1e-6, equal_nan=True)

    # --- leaving the local run --------------------------------------------------------------------

    def materialize(self, name: str, env: dict, cache: dict) -> None:
        """env[name] as a DTensor (its local tensor kept for later local readers)."""
        value = env.get(name)
        if not isinstance(value, Local):
            return
        cache[(name, "local")] = value.value
        env[name] = DTensor.from_local(value.value, self.interpreter.mesh, [to_dtensor_placement(value.placement)],
                                       run_check=False)

    def read_outside(self, nodes: list[torch.fx.Node]) -> frozenset[str]:
        """Nodes of `nodes` that something after them (another run, segment or the output) reads."""
        key = (id(nodes[0]), id(nodes[-1]), len(nodes)) if nodes else ()
        if key not in self._outside:
            inside = {id(node) for node in nodes}
            self._outside[key] = frozenset(node.name for node in nodes
                                           if any(id(user) not in inside for user in node.users))
        return self._outside[key]


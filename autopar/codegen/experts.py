"""Expert parallelism at run time: expert weights split by expert over an ep group of dp ranks,
tokens exchanged by all-to-all around each expert matmul or chain of them (the plan's `ep`,
solver/experts.py).

Mesh. The ranks are laid out (pp, dp, tp) with tp fastest; dp = dp_rep x ep with ep fastest, so an
expert group is ep consecutive dp ranks. An expert weight is a DTensor on the (tp, ep) sub-mesh,
placed (its tensor-parallel placement, Shard(0)): tp first, so that with experts also split on
tp (Shard(0) twice) rank (t, c) holds block t x ep + c, the c-th ep block of tp rank t's experts,
which is what the dispatch below sends it. Under context parallelism the expert group is ep
consecutive dp ranks of one cp index (each exchanges its own sequence shard's tokens), and under
ZeRO-1/2/3 FSDP2 shards each block's expert weights over the ranks holding the same experts
(dp_rep x cp: codegen/data_parallel.py, codegen/runtime.expert_device_mesh).

One expert op (an einsum/bmm whose weight operand is an expert weight) runs as
    tokens  (this rank's tensor-parallel shard) --dispatch--> the tokens of every rank of the
            group for this rank's experts: split along the expert dim into ep blocks, block j to
            rank j (all_to_all_single), the received blocks stacked along the token dim
    the op  on the local expert weights
    output  --combine--> this rank's tokens for every expert (the inverse exchange)
Both exchanges are even (every block the same size: the shapes are static), so each is one
`all_to_all_single`, supported by gloo and NCCL; its backward is the same exchange reversed.

A grouped matmul (rows sorted by expert, `offs[e]` the end of expert e's rows) is dropless: each
rank first sends every other rank how many of its rows go to each of that rank's experts (an
all-to-all of counts), then the rows (uneven splits), reorders what it received from
source-major to expert-major (with more than one local expert: the price's ep.reorder,
solver/experts.py), runs the grouped matmul on its experts, and sends the rows back in the order
they came (the backward exchanges the gradients alike).

Chains (solver/experts.py): the first op of a chain dispatches and keeps its output on the
dispatched rows (`Dispatched`: the value, as planned on tp, and for a grouped mm the `Route`
back: the expert-major order, local offsets, rows sent and received); the row-local ops between
run as planned on those rows (the interpreter unwraps and re-wraps them); the last op runs on the
same rows with the same local offsets and combines. Autograd flows through the all-to-alls'
functions as for one op: the backward dispatches the last op's output gradient and combines the
first op's token gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.fx.node import map_aggregate

from autopar.codegen.placements import to_dtensor_placement
from autopar.solver.experts import ExpertOp


class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 goes to rank j of `group`; block j of the result came from rank j."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        value = value.contiguous()  # empty_like keeps a view's strides; the collective writes row-major
        received = torch.empty_like(value)
        dist.all_to_all_single(received, value, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        returned = torch.empty_like(grad)
        dist.all_to_all_single(returned, grad, group=ctx.group)
        return returned, None


class _AllToAllUneven(torch.autograd.Function):
    """Rows [0, sent[0]) go to rank 0, the next sent[1] to rank 1...; received[j] rows come from rank j."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group = received, sent, group
        output = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(output, rows.contiguous(), received, sent, group=group)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        returned = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(returned, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return returned, None, None, None


@dataclass(frozen=True)
class Route:
    """How one rank's rows of a grouped expert op were dispatched: what the combine undoes."""

    order: torch.Tensor | None
    """Positions, in the rows received source after source, of the rows in expert-major order
    (None: one local expert, the two orders are the same)."""
    local_offsets: torch.Tensor
    """End row of each of this rank's experts in the expert-major rows."""
    sent: list[int]
    """Rows this rank sent to each rank of the group."""
    received: list[int]
    """Rows this rank received from each rank."""
    rows: int
    """Rows of this rank's token operand (those past the last expert's end are unused: zeros)."""


@dataclass(frozen=True)
class Dispatched:
    """A value of a chain (solver/experts.py) on this rank's experts: the rows dispatched to it,
    expert-major (grouped mm, `route` set), or the einsum tokens after `dispatch` (route None)."""

    value: torch.Tensor
    route: Route | None = None

    def wrap(self, result):
        """`result` (a tensor, or a list/tuple of them) of an op on these rows, dispatched alike."""
        if isinstance(result, torch.Tensor):
            return Dispatched(result, self.route)
        if isinstance(result, (list, tuple)):
            return type(result)(self.wrap(item) for item in result)
        return result


def dispatch_rows(tokens: torch.Tensor, offsets: torch.Tensor, group, ep: int) -> Dispatched:
    """This rank's rows (sorted by expert, `offsets[e]` the end of expert e's) -> the rows of
    every rank of `group` for this rank's experts, expert-major: counts, then rows, exchanged."""
    local_experts = offsets.shape[0] // ep
    used = int(offsets[-1])
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source][my expert], flattened
    by_source = received_counts.view(ep, local_experts)
    sent = counts.view(ep, local_experts).sum(dim=1).tolist()
    received = by_source.sum(dim=1).tolist()
    rows = _AllToAllUneven.apply(tokens[:used], received, sent, group)
    # With one local expert the received rows are already expert-major: no reorder (as
    # Megatron-Core's all-to-all dispatcher, which sorts only when num_local_experts > 1).
    order = _expert_major(by_source) if local_experts > 1 else None
    local_offsets = by_source.sum(dim=0).cumsum(dim=0).to(offsets.dtype)
    route = Route(order=order, local_offsets=local_offsets, sent=sent, received=received, rows=tokens.shape[0])
    return Dispatched(rows if order is None else rows[order], route)


def combine_rows(output: torch.Tensor, route: Route, group) -> torch.Tensor:
    """The inverse of `dispatch_rows`: expert-major rows of this rank's experts -> this rank's rows."""
    back = output if route.order is None else torch.empty_like(output).index_copy(0, route.order, output)
    mine = _AllToAllUneven.apply(back, route.sent, route.received, group)
    if mine.shape[0] == route.rows:
        return mine
    return torch.cat([mine, mine.new_zeros((route.rows - mine.shape[0], *mine.shape[1:]))])


def grouped_mm_expert_parallel(target, tokens: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, group,
                               ep: int, rest=(), kwargs=None) -> torch.Tensor:
    """`target(tokens, whole weight, offsets)` where this rank holds experts [c E/ep, (c+1) E/ep)
    of the weight (`weight`) and every rank of `group` its own tokens."""
    rows = dispatch_rows(tokens, offsets, group, ep)
    output = target(rows.value, weight, rows.route.local_offsets, *rest, **(kwargs or {}))
    return combine_rows(output, rows.route, group)


def _expert_major(by_source: torch.Tensor) -> torch.Tensor:
    """Positions, in rows received source after source (each sorted by expert), of the rows in
    expert-major order (every source's rows of expert 0, then of expert 1...)."""
    counts = by_source.tolist()
    starts, position = [], 0
    for source_counts in counts:
        row = []
        for count in source_counts:
            row.append(position)
            position += count
        starts.append(row)
    pieces = [torch.arange(starts[source][expert], starts[source][expert] + counts[source][expert])
              for expert in range(len(counts[0])) for source in range(len(counts))]
    return torch.cat(pieces).to(by_source.device) if pieces else by_source.new_zeros(0)


def dispatch(tokens: torch.Tensor, expert_dim: int, token_dim: int, group, ep: int) -> torch.Tensor:
    """[.., E, .., B, ..] on each rank -> [.., E / ep, .., ep B, ..]: rank c's experts, every rank's tokens."""
    return join_blocks(_AllToAll.apply(split_blocks(tokens, expert_dim, ep), group), token_dim)


def combine(outputs: torch.Tensor, expert_dim: int, token_dim: int, group, ep: int) -> torch.Tensor:
    """The inverse of `dispatch`: [.., E / ep, .., ep B, ..] -> this rank's [.., E, .., B, ..]."""
    return join_blocks(_AllToAll.apply(split_blocks(outputs, token_dim, ep), group), expert_dim)


def split_blocks(value: torch.Tensor, dim: int, ep: int) -> torch.Tensor:
    """`value` cut into ep blocks along `dim`, stacked on a new dim 0 (block j is for rank j)."""
    return value.unflatten(dim, (ep, value.shape[dim] // ep)).movedim(dim, 0)


def join_blocks(received: torch.Tensor, dim: int) -> torch.Tensor:
    """The blocks received from each rank (dim 0) laid end to end along `dim`, rank-major."""
    return received.movedim(0, dim).flatten(dim, dim + 1)


def expert_placements(tp_placement: str) -> list:
    """DTensor placements of an expert weight on the (tp, ep) mesh."""
    tp = to_dtensor_placement(tp_placement if tp_placement not in ("R", "P") else "R")
    return [tp, Shard(0)]


def distribute_expert_parameter(param: torch.Tensor, tp_placement: str, mesh, device: torch.device) -> nn.Parameter:
    """This rank's block of an expert weight as a DTensor on the (tp, ep) mesh (meta: NaN storage)."""
    placements = expert_placements(tp_placement)
    if param.device.type == "meta":
        from autopar.codegen.init import empty_shard

        return nn.Parameter(empty_shard(param.detach(), placements, mesh, device), requires_grad=param.requires_grad)
    local = distribute_tensor(param.detach().to(device), mesh, placements, src_data_rank=None).to_local()
    tensor = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


class ExpertRunner:
    """Runs the plan's expert ops expert-parallel (see the module docstring)."""

    def __init__(self, ops: dict[str, ExpertOp], group, ep: int, rows: dict[str, list[int]] | None = None) -> None:
        self.ops = ops
        """Expert op by node name (of the graph codegen runs), chains as they run (expert_ops_at)."""
        self.views = {view for op in ops.values() for view in op.weight_views}
        """Nodes between an expert weight and its op (run on the local expert block)."""
        self.between = {name for op in ops.values() for name in op.between}
        """Row-local nodes inside a chain: run on the dispatched rows (`unwrap`)."""
        self.group = group
        self.ep = ep
        self.rows = {} if rows is None else rows
        """{node of a dropless layer's first op: [rows received, rows sent]} (RunStats.expert_rows)."""
        self.float8 = None
        """Precision "fp8": the Float8GroupedMM (codegen/fp8_experts.py) whose nodes' local grouped
        matmuls run in float8; None: every op runs its own target."""

    @staticmethod
    def run_view(node: torch.fx.Node, env: dict):
        """A transpose of an expert weight, on this rank's block of it."""
        def local(value):
            if isinstance(value, torch.fx.Node):
                value = env[value.name]
            return _as_local(value)

        return node.target(*map_aggregate(node.args, local), **map_aggregate(dict(node.kwargs), local))

    @staticmethod
    def unwrap(node: torch.fx.Node, env: dict) -> tuple[dict, Dispatched]:
        """(its inputs by name, the dispatched rows as planned: a DTensor on the tp mesh or a
        plain tensor; one of the dispatched inputs) of a chain's row-local op."""
        found: list[Dispatched] = []

        def local(value):
            if isinstance(value, (list, tuple)) and any(isinstance(item, Dispatched) for item in value):
                return type(value)(local(item) for item in value)  # a cut's outputs, read by a getitem
            if isinstance(value, Dispatched):
                found.append(value)
                return value.value
            return value

        inputs = {source.name: local(env[source.name]) for source in node.all_input_nodes}
        return inputs, found[0]

    def run_bias(self, node: torch.fx.Node, env: dict) -> Dispatched:
        """A chain's per-expert bias (`expert_bias`): on the dispatched rows, with this rank's
        experts' block of the bias and their local offsets (local tensors: not through the
        interpreter's placed inputs, which are the whole bias and the global offsets)."""
        rows, bias = env[node.args[0].name], env[node.args[1].name]
        route = rows.route
        num_local = route.local_offsets.shape[0]
        first = dist.get_rank(self.group) * num_local
        value = rows.value
        output = node.target(_as_local(value), _as_local(bias)[first:first + num_local], route.local_offsets)
        if isinstance(value, DTensor):
            output = DTensor.from_local(output, value.device_mesh, value.placements, run_check=False)
        return rows.wrap(output)

    def run(self, node: torch.fx.Node, args: tuple, kwargs: dict, tp_mesh, output_placement: str | None,
            partial_token_grad: bool):
        """`args` hold the token operand as the plan placed it on tp (or, inside a chain, as the
        previous op left it: Dispatched) and the expert weight (a DTensor on the (tp, ep) mesh) as
        it is. Replicated tokens of an op whose weight is split on tp (column or row parallel) get
        partial gradients from each tp rank: `partial_token_grad`."""
        op = self.ops[node.name]
        position = 0
        if op.kind == "grouped_mm":
            return self._grouped_mm(op, node, args, kwargs, tp_mesh, output_placement, partial_token_grad)

        def local(value):
            nonlocal position
            if not isinstance(value, (torch.Tensor, Dispatched)):
                return value
            index, position = position, position + 1
            if isinstance(value, Dispatched):
                return _token_local(value.value, partial_token_grad)
            if index == op.token_input:
                return dispatch(_token_local(value, partial_token_grad), op.token_expert_dim, op.token_split_dim,
                                self.group, self.ep)
            return _as_local(value)

        output = node.target(*map_aggregate(args, local), **map_aggregate(kwargs, local))
        if op.chain_to:
            return Dispatched(_placed(output, tp_mesh, output_placement))
        output = combine(output, op.output_expert_dim, op.output_split_dim, self.group, self.ep)
        return _placed(output, tp_mesh, output_placement)

    def _grouped_mm(self, op: ExpertOp, node, args, kwargs, tp_mesh, output_placement, partial_token_grad: bool):
        tokens, weight, offsets, *rest = args
        weight, offsets = _as_local(weight), _as_local(offsets)
        if isinstance(tokens, Dispatched):
            rows = tokens.wrap(_token_local(tokens.value, partial_token_grad))
        else:
            rows = dispatch_rows(_token_local(tokens, partial_token_grad), offsets, self.group, self.ep)
            counted = self.rows.setdefault(node.name, [0, 0])
            counted[0] += sum(rows.route.received)
            counted[1] += sum(rows.route.sent)
        target = self.float8.matmul(node) if self.float8 is not None and node.name in self.float8.nodes \
            else node.target
        output = target(rows.value, weight, rows.route.local_offsets, *rest, **(kwargs or {}))
        if op.chain_to:
            return rows.wrap(_placed(output, tp_mesh, output_placement))
        return _placed(combine_rows(output, rows.route, self.group), tp_mesh, output_placement)


def _placed(output: torch.Tensor, tp_mesh, output_placement: str | None):
    if tp_mesh is None:
        return output
    return DTensor.from_local(output, tp_mesh, [to_dtensor_placement(output_placement or "R")], run_check=False)


def _token_local(value, partial_grad: bool) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value
    replicated = isinstance(value.placements[0], Replicate)
    if replicated and value.requires_grad and partial_grad:
        return value.to_local(grad_placements=[Partial()])
    return value.to_local()


def _as_local(value):
    """A DTensor's local tensor; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value

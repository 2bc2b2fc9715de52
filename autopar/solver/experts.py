"""Expert parallelism: which ops are an MoE layer's expert matmuls, and what sharding them by
expert over an `ep` group costs.

Expert parallelism borrows the ranks of the data-parallel group (torchtitan does the same): ep
consecutive dp ranks form an expert group, each holding num_experts / ep of every expert
weight. An expert matmul then runs in three steps on each rank (codegen/experts.py):

    dispatch   all-to-all over the ep group: the slice of the token operand that belongs to
               expert block j goes to rank j, which receives its experts' tokens of every rank
    compute    the matmul of those tokens with the rank's own experts (the same FLOPs as the
               whole matmul of its own tokens when the load is even)
    combine    all-to-all back: every rank gets its own tokens' outputs

and in the backward the same two all-to-alls in reverse (the output gradient is dispatched,
the token gradient combined).

Chains: one dispatch and one combine per MoE layer, as Megatron-Core and torchtitan run it. Two
expert ops A -> B of the same kind and experts (grouped mm: the same `offs` node; einsum/bmm: B's
token expert and token dims are A's output's) form a chain where B's token operand is reached from
A's output only through row-local ops (elementwise ops, casts, and chunk/split/slice/unbind/
unflatten/getitem along a dim the exchange does not touch: not the rows of a grouped mm, not an
einsum's expert or token dim), every tensor operand of those ops is A's output, another of them,
or a 0-d parameter or constant, none of them (A's output included) is read outside the chain, and
all lie in one segment
(no pipeline boundary inside); a per-expert bias added to the rows by their expert
(`expert_bias(rows, bias, offs)` with the chain's offsets: GPT-OSS's gate/up bias) is row-local
too, run on the rank's block of the bias and its local offsets. The chain dispatches A's tokens
(and, dropless, exchanges the counts) once, runs A, the ops between and B on the rank's own
experts, and combines B's output once: a SwiGLU layer moves H per token copy each way instead of
H + 2F + F + H. Backward: B's output gradient is dispatched, A's token gradient combined; the
intermediates stay where they are.
A chain runs where the plan's tensor-parallel placements split none of its values along the rows
(`expert_ops_at`): the ops between then run as planned (DTensors on the tp mesh) on rows that are
the same on every tp rank. Elsewhere each op exchanges its own input and output (four all-to-alls
forward and four backward for a two-matmul layer). Not chained: ops whose tokens meet a tensor
from outside between them (Hugging Face's GPT-OSS adds a bias gathered per row by its expert;
the built-in family's `expert_bias` op chains).
Expert weights' gradients are complete on their owner (the tokens of every rank of the group
reached it), so data parallelism reduces them over the dp / ep ranks that hold the same experts,
not over the whole dp group.

Recognised expert matmuls (an op of the graph reading a 3-D trainable parameter, only read by
such ops, whose dim 0 is the expert dim):
    einsum/bmm  the parameter's first letter (the expert letter) is kept in the output and in the
                token operand, and the token operand has a letter the parameter lacks that the
                output keeps (the tokens: GShard's capacity-padded "egcm,emf->egcf"); the tokens
                are exchanged along that letter. Shapes are static, so the load is what the shapes
                say: capacity padding is already in the FLOPs and bytes, overflow is dropped.
    grouped mm  `grouped_mm(tokens[S, K], weight[E, K, N], offs[E])` over tokens sorted by expert
                (Hugging Face's Mixtral, Qwen2-MoE), the weight a parameter or a transpose of one
                keeping dim 0. Dropless: how many tokens each expert gets follows the routing, so
                each op first exchanges its per-expert counts (one more small all-to-all), then
                the rows themselves (uneven splits).

Load imbalance: under dropless routing the busiest rank receives and computes more than the even
share; its price is `ExpertPricing.load_imbalance` times the even share, a parameter (Switch
Transformer and GShard train with a capacity factor of 1.25; 1.0 prices force-balanced routing),
not fitted: `autopar plan --moe-load-imbalance X`.

Reorder (`ExpertPricing.reorder_s`, the breakdown's ep.reorder): a rank holding more than one
expert receives its rows source-major (every source's rows for its experts, each source's sorted by
expert) and the expert matmul wants them expert-major, so the rows are reordered after the dispatch
and back before the combine, and alike for the gradients in the backward: one read and one write of
the dispatched rows per all-to-all, memory-bound, one kernel each. Megatron-Core's all-to-all
dispatcher does it with `sort_chunks_by_idxs` in dispatch_postprocess / combine_preprocess, only
when num_local_experts > 1 (megatron/core/transformer/moe/token_dispatcher.py,
MoEAlltoAllTokenDispatcher; split + cat, or TE's fused_sort_chunks_by_index under
moe_permute_fusion); autopar's runtime with `rows[order]` and `index_copy` (codegen/experts.py,
skipped with one local expert) and, for an einsum's even exchange, the copy that lays the received
blocks along the token dim (`join_blocks` of more than one local expert; `split_blocks` before the
combine). Megatron-Core's flex dispatcher (DeepEP, HybridEP) writes the received rows
expert-major inside its dispatch kernel and reads them back so in its combine: no reorder pass
(`ExpertPricing.fused_permute`; _HybridEPManager: "permute tokens for experts in single step").

Grouped-matmul shapes: a grouped matmul of S rows over the E experts of a device runs E matmuls
of S / E rows (cost_model/compute.py prices each at its own size's rate). Under ep the rank holds
E / ep experts and receives the group's rows for them: E / ep matmuls of ep x S / E rows each,
times the load imbalance on the busiest rank (GroupedMatmul.time_s). The change from the price
without ep is part of the stage's compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar.errors import ConfigError
from autopar.graph import OpGraph, OpNode
from autopar.strategies.grouped_mm import EXPERT_BIAS_TARGETS, GROUPED_MM_TARGETS
from autopar.strategies.pointwise import CASTS, NONLINEAR_NARY, NONLINEAR_UNARY

EINSUM_TARGETS = ("aten.einsum.default",)
BMM_TARGETS = ("aten.bmm.default",)
DEFAULT_LOAD_IMBALANCE = 1.25
"""Switch Transformer's and GShard's capacity factor: the default busiest-rank share of dropless routing."""
WEIGHT_VIEWS = ("aten.transpose.int", "aten.t.default")
"""Ops between an expert weight and a grouped mm that keep dim 0 (checked by shape)."""
ELEMENTWISE = NONLINEAR_UNARY + NONLINEAR_NARY + CASTS + (
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.add.Scalar", "aten.sub.Scalar", "aten.neg.default", "aten.type_as.default")
"""Row-local ops a chain may hold between two expert ops (every tensor operand the output's shape)."""
CUTS = {"aten.chunk.default": 2, "aten.split.Tensor": 2, "aten.split_with_sizes.default": 2,
        "aten.slice.Tensor": 1, "aten.unbind.int": 1, "aten.unflatten.int": 1}
"""Ops a chain may hold that cut, unbind or unflatten along a dim (-> the position of the dim
argument, default 0): none of them names a row count (unflatten's sizes are the dim's own)."""


@dataclass(frozen=True, kw_only=True)
class ExpertOp:
    """One expert matmul and how its operands are exchanged over the ep group."""

    node: str
    """The op's node name."""
    param: str
    """Node name of the expert weight (a trainable parameter)."""
    weight_input: int
    """Index into the op's tensor inputs of the expert weight."""
    token_input: int
    """Index into the op's tensor inputs of the token operand."""
    num_experts: int
    token_expert_dim: int
    """Dim of the token operand indexed by expert (split into ep blocks by the dispatch)."""
    token_split_dim: int
    """Dim of the token operand along which the ranks' tokens are stacked after the dispatch."""
    output_expert_dim: int
    output_split_dim: int
    dropless: bool = False
    """Tokens per expert follow the routing (priced with the load imbalance); False: static shapes."""
    kind: str = "einsum"
    """"einsum" (einsum or bmm, even exchanges) or "grouped_mm" (rows sorted by expert, uneven)."""
    weight_views: tuple[str, ...] = ()
    """Nodes from the parameter to the op (a transpose), run on the local expert block."""
    chain_from: str = ""
    """The expert op whose output, still dispatched, reaches this op's tokens (a chain, see the
    module docstring): no dispatch, no counts here."""
    chain_to: str = ""
    """The expert op this op's output reaches, still dispatched: no combine here."""
    between: tuple[str, ...] = ()
    """Of a chain's last op: the row-local nodes from `chain_from` to it (run on dispatched rows)."""


@dataclass(frozen=True, kw_only=True)
class ExpertPricing:
    """Assumptions of the expert-parallel price."""

    load_imbalance: float = DEFAULT_LOAD_IMBALANCE
    """Tokens the busiest ep rank receives and computes, over the even share, for dropless expert
    ops (capacity-padded ones have static shapes). Switch/GShard's capacity factor 1.25; 1.0 is
    force-balanced routing (how NVIDIA's published MoE throughputs are measured)."""

    fused_permute: bool = False
    """The runtime's dispatch kernel writes the received rows expert-major and its combine reads
    them so (Megatron-Core's flex dispatcher: DeepEP, HybridEP): no reorder pass around the
    expert matmuls. False: the rows are reordered after each dispatch and before each combine
    when a rank holds more than one expert (autopar's runtime, Megatron-Core's all-to-all
    dispatcher; module docstring)."""

    tp_share_dispatch: bool = False
    """Where the experts are split on tp (etp = tp > 1, not folded) and so every tp rank holds the
    same rows, each tp rank dispatches only its 1/tp of them, and the ranks of a tp group
    all-gather what they received before the expert matmuls and reduce-scatter the partial
    outputs before the combine (the breakdown's ep.tp_all_gather, ep.tp_reduce_scatter): the
    all-to-alls move 1/tp of the rows (Megatron-Core's all-to-all dispatcher under sequence
    parallelism, which dispatches each rank's sequence shard and calls
    gather_from_sequence_parallel_region after the all-to-all). False: every tp rank dispatches
    all the rows (autopar's runtime, codegen/experts.py)."""

    def __post_init__(self) -> None:
        check_load_imbalance(self.load_imbalance)

    def reorder_s(self, message_bytes: float, device_experts: int, ep: int, compute) -> float:
        """The reorder of one dispatched or combined message of `message_bytes` (what the busiest
        rank receives or sends): one read and one write of its rows at the device's memory
        bandwidth plus one kernel launch (`compute`: a ComputeModel), where the rank holds more
        than one of the `device_experts` (experts on the device before ep) and the dispatch does
        not fuse it; else 0."""
        if self.fused_permute or ep <= 1 or device_experts // ep <= 1:
            return 0.0
        return 2 * message_bytes / compute.bandwidth_bytes_per_s + compute.overhead_s


def check_load_imbalance(value) -> float:
    """`value` as a load imbalance (a finite number >= 1.0), else a ConfigError saying so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1.0:
        raise ConfigError(f"the MoE load imbalance must be a finite number >= 1.0 (tokens the busiest expert rank "
                          f"gets over the even share: 1.0 = balanced routing, {DEFAULT_LOAD_IMBALANCE} = the "
                          f"default), got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class ExpertExchange:
    """What one expert op moves over the ep group per microbatch, per device (before ep)."""

    token_bytes: float
    """The token operand on this device (its tensor-parallel shard)."""
    output_bytes: float
    token_grad: bool
    """The token operand needs a gradient (the backward combines it)."""
    dropless: bool
    compute_s: float
    """The op's forward + backward compute on this device."""
    count_bytes: float = 0.0
    """Per-expert token counts exchanged before a dropless op's rows (0: static shapes, none)."""
    matmuls: tuple[GroupedMatmul, ...] = ()
    """A grouped op's matmul kernels on this device without expert parallelism (what ep reshapes)."""
    dispatches: bool = True
    """It dispatches its tokens (False: they arrive dispatched from the previous op of its chain)."""
    combines: bool = True
    """It combines its output (False: the output stays dispatched for the next op of its chain)."""
    device_experts: int = 0
    """Experts of the op on this device before ep (its weight's expert dim over the tp shards
    that split it): with ep, more than one per rank means a reorder around the matmul."""
    rows_whole: bool = True
    """No tp placement splits the token operand's rows (every tp rank holds them all): what
    ExpertPricing.tp_share_dispatch divides among the tp ranks."""

    def messages(self) -> tuple[tuple[float, str, str], ...]:
        """(bytes each rank sends and receives, phase, part) of its all-to-alls: the counts
        (dropless), dispatch and combine forward; the output gradient dispatched and the token
        gradient combined backward. Parts: "counts", "dispatch", "combine". Within a chain the
        first op only dispatches (and exchanges counts), the last only combines."""
        forward, backward = [], []
        if self.dispatches:
            forward += ([(self.count_bytes, "fwd", "counts")] if self.count_bytes else []) + [
                (self.token_bytes, "fwd", "dispatch")]
            backward += [(self.token_bytes, "bwd", "combine")] if self.token_grad else []
        if self.combines:
            forward.append((self.output_bytes, "fwd", "combine"))
            backward.insert(0, (self.output_bytes, "bwd", "dispatch"))
        return tuple(forward + backward)


@dataclass(frozen=True, kw_only=True)
class GroupedMatmul:
    """One grouped-matmul kernel of an expert op, as priced without expert parallelism."""

    phase: str
    """"fwd" or "bwd"."""
    flops: float
    """On this device (all its experts)."""
    experts: int
    """Experts on this device (the kernel's groups)."""
    dtype: str
    io_bytes: float = 0.0
    """Bytes it reads and writes on this device (all its experts)."""
    expert_bytes: float = 0.0
    """Of io_bytes, the per-expert operands' (weights, weight gradients: Kernel.expert_bytes)."""
    alone_s: float = 0.0
    """Its time without expert parallelism (in the segment's compute): the most ep can save."""

    def time_s(self, compute, ep: int = 1, load_imbalance: float = 1.0) -> float:
        """Its time on the busiest rank of an ep group: experts / ep matmuls of ep x the rows each
        (the group's tokens for the rank's experts), `load_imbalance` x the even share; bounded
        by the bytes it moves, the rows' and its own experts' weights (the roofline segment
        compute prices it by: all E experts' weights read on one device can outweigh its FLOPs)."""
        experts = max(self.experts // ep, 1)
        flops = self.flops * load_imbalance
        io_bytes = (self.io_bytes - self.expert_bytes) * load_imbalance + self.expert_bytes * experts / self.experts
        return max(compute.grouped_matmul_s(flops, flops / experts, self.dtype),
                   io_bytes / compute.bandwidth_bytes_per_s)


def find_expert_ops(graph: OpGraph) -> tuple[ExpertOp, ...]:
    """The expert matmuls of `graph` that can run expert-parallel (see the module docstring)."""
    found = []
    for node in graph.calls():
        op = _einsum_expert_op(graph, node) or _grouped_mm_expert_op(graph, node)
        if op is not None:
            found.append(op)
    readers_ok = _params_read_only_by(graph, found)
    return _chained(graph, tuple(op for op in found if op.param in readers_ok))


def expert_ops_at(ops: tuple[ExpertOp, ...], placements: Callable[[str], tuple | None]) -> tuple[ExpertOp, ...]:
    """The expert ops as they run under the plan's tensor-parallel placements: `placements(node)`
    is its strategy's (output, inputs) placements, each a tuple with one per mesh axis, or None.
    A chain runs where none of its values (the first op's tokens and output, the ops between,
    the last op's tokens) is split along a dim the exchange keeps (grouped mm: the rows; einsum:
    the expert or token dim) on any axis: every tp rank then dispatches the same rows, so the ops
    between run as planned on DTensors of them. Elsewhere each op exchanges its own operands."""
    by_node = {op.node: op for op in ops}
    broken = set()
    for op in ops:
        if op.chain_from and not _chain_runs(by_node[op.chain_from], op, placements):
            broken |= {op.node, op.chain_from}
    return tuple(replace(op, chain_from="", chain_to="", between=()) if op.node in broken else op for op in ops)


def row_splits(op: ExpertOp) -> set[str]:
    """The placements that split an expert op's token rows (grouped mm: dim 0; einsum: its expert
    and token dims), which its exchange keeps."""
    dims = (0,) if op.kind == "grouped_mm" else (op.token_expert_dim, op.token_split_dim)
    return {f"S{dim}" for dim in dims}


def _chain_runs(first: ExpertOp, last: ExpertOp, placements: Callable[[str], tuple | None]) -> bool:
    kept = row_splits(last)
    values = []
    for name, token_input in ((first.node, first.token_input), (last.node, last.token_input)):
        found = placements(name)
        if found is not None:
            values += list(found[1][token_input:token_input + 1]) + ([found[0]] if name == first.node else [])
    for name in last.between:
        found = placements(name)
        if found is not None:
            values += [found[0], *found[1]]
    return not any(placement in kept for value in values for placement in value)


def _chained(graph: OpGraph, ops: tuple[ExpertOp, ...]) -> tuple[ExpertOp, ...]:
    """`ops` with their chains marked (pairs A -> B, see the module docstring)."""
    by_node = {op.node: op for op in ops}
    if len(ops) < 2:
        return ops
    segment_of = {name: segment.name for segment in graph.segments for name in segment.nodes}
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    links: dict[str, tuple[str, tuple[str, ...]]] = {}
    for op in ops:
        link = _chain_from(graph, op, by_node, segment_of, order)
        if link is not None and link[0] not in links:
            links[link[0]] = (op.node, link[1])
    ends = {end: (start, between) for start, (end, between) in links.items()}
    chained = []
    for op in ops:
        start, between = ends.get(op.node, ("", ()))
        end = links.get(op.node, ("",))[0]
        chained.append(replace(op, chain_from=start, chain_to=end, between=between) if start or end else op)
    return tuple(chained)


def _chain_from(graph: OpGraph, op: ExpertOp, by_node: dict[str, ExpertOp], segment_of: dict[str, str],
                order: dict[str, int]) -> tuple[str, tuple[str, ...]] | None:
    """(the expert op A whose output reaches `op`'s tokens only through row-local ops, those
    ops in graph order), or None."""
    node = graph[op.node]
    members: set[str] = set()
    frontier = [node.inputs[op.token_input]]
    start = None
    while frontier:
        name = frontier.pop()
        if name in members:
            continue
        if name in by_node and name != op.node:
            if start not in (None, name):
                return None
            start = name
            members.add(name)
            continue
        producer = graph[name]
        if _expert_bias(graph, producer, op):
            members.add(name)
            frontier.append(producer.inputs[0])  # the bias and offsets are read for the rank's experts
            continue
        if not _row_local(graph, producer, op):
            return None
        members.add(name)
        frontier += [source for source in producer.inputs if not _scalar_constant(graph[source])]
    if start is None or not _links(graph, by_node[start], op):
        return None
    inside = members | {op.node}
    if any(set(graph.consumers.get(name, ())) - inside for name in members):
        return None  # a chain value is read outside the chain
    if len({segment_of.get(name) for name in inside}) != 1:
        return None
    return start, tuple(sorted(members - {start}, key=order.__getitem__))


def _links(graph: OpGraph, first: ExpertOp, last: ExpertOp) -> bool:
    """`first`'s dispatched output is what `last` would dispatch (same kind, experts and layout)."""
    if first.kind != last.kind or first.num_experts != last.num_experts:
        return False
    if first.kind == "grouped_mm":
        return graph[first.node].inputs[2] == graph[last.node].inputs[2]
    return (first.output_expert_dim, first.output_split_dim) == (last.token_expert_dim, last.token_split_dim)


def _row_local(graph: OpGraph, node: OpNode, op: ExpertOp) -> bool:
    """`node` keeps every row where it was (see the module docstring): for a grouped mm, dim 0;
    for an einsum/bmm, its expert and token dims."""
    if node.kind != "call" or not node.outputs:
        return False
    kept = {0} if op.kind == "grouped_mm" else {op.token_expert_dim, op.token_split_dim}
    tensors = [graph[source] for source in node.inputs if not _scalar_constant(graph[source])]
    if node.target == "getitem":
        return len(tensors) == 1
    if len(tensors) != 1 and node.target in CUTS or not tensors:
        return False
    shape = tensors[0].output.shape
    if any(tensor.output.shape != shape for tensor in tensors):
        return False
    if node.target in ELEMENTWISE:
        return node.output.shape == shape
    if node.target in CUTS:
        position = CUTS[node.target]
        dim = node.args[position] if len(node.args) > position else node.kwarg("dim", 0)
        return isinstance(dim, int) and dim % len(shape) not in kept
    return False


def _expert_bias(graph: OpGraph, node: OpNode, op: ExpertOp) -> bool:
    """`node` adds a per-expert bias to the rows of `op`'s routing (`expert_bias(rows, bias, offs)`
    with `op`'s offsets and a bias [num_experts, N]): row-local on dispatched rows given the rank's
    block of the bias and its local offsets (codegen/experts.py)."""
    if node.kind != "call" or node.target not in EXPERT_BIAS_TARGETS or len(node.inputs) != 3:
        return False
    bias, offsets = graph[node.inputs[1]], graph[node.inputs[2]]
    return (op.kind == "grouped_mm" and node.inputs[2] == graph[op.node].inputs[2]
            and len(bias.output.shape) == 2 and bias.output.shape[0] == op.num_experts
            and tuple(offsets.output.shape) == (op.num_experts,))


def _scalar_constant(node: OpNode) -> bool:
    """A 0-d parameter, buffer or constant: the same on every rank, so fine next to dispatched rows."""
    return node.kind in ("param", "buffer", "constant") and node.outputs and node.output.shape == ()


def expert_param_names(graph: OpGraph, ops: tuple[ExpertOp, ...]) -> tuple[str, ...]:
    """FQNs of the expert weights, in graph order."""
    nodes = {op.param for op in ops}
    return tuple(param.name for param in graph.params if param.node in nodes)


def _params_read_only_by(graph: OpGraph, ops: list[ExpertOp]) -> set[str]:
    """Expert weights every reader of which is an expert op (or a view leading only to one)."""
    by_param: dict[str, set[str]] = {}
    for op in ops:
        chain = op.weight_views + (op.node,)
        by_param.setdefault(op.param, set()).add(chain[0])
        for view, after in zip(chain, chain[1:]):
            if set(graph.consumers.get(view, ())) != {after}:
                by_param[op.param].add("<other reader>")
    return {param for param, readers in by_param.items()
            if "<other reader>" not in readers and set(graph.consumers.get(param, ())) <= readers}


def _grouped_mm_expert_op(graph: OpGraph, node: OpNode) -> ExpertOp | None:
    if node.target not in GROUPED_MM_TARGETS or len(node.inputs) != 3:
        return None
    tokens, weight, offsets = (graph[name] for name in node.inputs)
    if len(tokens.output.shape) != 2 or len(weight.output.shape) != 3 or len(offsets.output.shape) != 1:
        return None
    views: list[str] = []
    while weight.kind == "call" and weight.target in WEIGHT_VIEWS and len(weight.inputs) == 1:
        source = graph[weight.inputs[0]]
        if len(source.output.shape) != 3 or source.output.shape[0] != weight.output.shape[0]:
            return None
        views.insert(0, weight.name)
        weight = source
    if weight.kind != "param" or not weight.requires_grad or weight.output.shape[0] < 2:
        return None
    return ExpertOp(node=node.name, param=weight.name, weight_input=1, token_input=0,
                    num_experts=weight.output.shape[0], token_expert_dim=0, token_split_dim=0, output_expert_dim=0,
                    output_split_dim=0, dropless=True, kind="grouped_mm", weight_views=tuple(views))


def _einsum_expert_op(graph: OpGraph, node: OpNode) -> ExpertOp | None:
    spec = _letters(node)
    if spec is None or len(node.inputs) != 2:
        return None
    operands, output = spec
    shapes = [graph[name].output.shape for name in node.inputs]
    if any(len(letters) != len(shape) for letters, shape in zip(operands, shapes)):
        return None
    for weight_input in (0, 1):
        param = graph[node.inputs[weight_input]]
        if param.kind != "param" or not param.requires_grad or len(param.output.shape) != 3:
            continue
        token_input = 1 - weight_input
        if graph[node.inputs[token_input]].kind in ("param", "buffer", "constant"):
            continue
        weight_letters, token_letters = operands[weight_input], operands[token_input]
        expert = weight_letters[0]
        if expert not in token_letters or expert not in output or param.output.shape[0] < 2:
            continue
        token_only = [letter for letter in token_letters if letter in output and letter not in weight_letters]
        if not token_only:
            continue
        return ExpertOp(node=node.name, param=param.name, weight_input=weight_input, token_input=token_input,
                        num_experts=param.output.shape[0], token_expert_dim=token_letters.index(expert),
                        token_split_dim=token_letters.index(token_only[0]),
                        output_expert_dim=output.index(expert), output_split_dim=output.index(token_only[0]))
    return None


def _letters(node: OpNode) -> tuple[tuple[str, str], str] | None:
    """(operand letters, output letters) of an einsum or bmm node."""
    if node.target in EINSUM_TARGETS:
        equation = node.args[0] if node.args and isinstance(node.args[0], str) else ""
        if "->" not in equation or "..." in equation:
            return None
        left, output = equation.replace(" ", "").split("->")
        operands = tuple(left.split(","))
        return ((operands[0], operands[1]), output) if len(operands) == 2 else None
    if node.target in BMM_TARGETS:
        return ("emk", "ekn"), "emn"
    return None


def ep_degrees(graph: OpGraph, ops: tuple[ExpertOp, ...], strategies: dict, dp: int, tp: int) -> list[int]:
    """Expert-parallel degrees (> 1) that divide dp and every expert op's experts per tp rank,
    under the tensor-parallel strategies chosen for the ops (tokens must not be Partial on tp:
    the exchange moves whole values)."""
    local_experts, blocker = _local_experts(ops, strategies, tp)
    if blocker:
        return []
    return [ep for ep in range(2, dp + 1) if dp % ep == 0 and all(n % ep == 0 for n in local_experts)]


def ep_blocker(ops: tuple[ExpertOp, ...], strategies: dict, dp: int, tp: int, ep: int) -> str:
    """Why `ep` is not an expert-parallel degree on a dp x tp mesh ("" when it is one)."""
    local_experts, blocker = _local_experts(ops, strategies, tp)
    if blocker:
        return blocker
    if dp % ep:
        return f"ep={ep} does not divide dp={dp}"
    uneven = sorted({n for n in local_experts if n % ep})
    return f"the {uneven[0]} experts per tp rank of an expert layer do not split into ep={ep} groups" if uneven else ""


def _local_experts(ops: tuple[ExpertOp, ...], strategies: dict, tp: int) -> tuple[list[int], str]:
    """(experts per tp rank of each expert op, "" or why the tensor-parallel plan rules ep out)."""
    if not ops:
        return [], "the model has no expert matmuls"
    local_experts = []
    for op in ops:
        strategy = strategies.get(op.node)
        if strategy is None:
            return [], f"expert op {op.node} has no tensor-parallel strategy"
        if any(placement == "P" for placement in strategy.inputs[op.token_input]):
            return [], f"the tp={tp} plan leaves the tokens of expert op {op.node} partial"
        weight = strategy.inputs[op.weight_input]
        if op.kind == "grouped_mm" and "S0" in weight:
            # rows of other tp ranks' experts would need zeros: not combined with ep (the intra-op
            # solve leaves this split out, sharding_problem._splits_experts; a fixed strategy may not)
            return [], (f"the tp={tp} plan splits the experts of {op.node} over tp, which expert parallelism "
                        "cannot combine with; use tp=1, ep=1 or etp=1 (MoE parallel folding: the experts unsplit "
                        "by tp, the ep group over tp x dp)")
        if any(strategy.input_grad(op.weight_input, axis, True) == "P" for axis in range(len(weight))):
            return [], f"the tp={tp} plan leaves the gradient of {op.node}'s expert weight partial"
        local_experts.append(op.num_experts // (tp if "S0" in weight else 1))
    return local_experts, ""

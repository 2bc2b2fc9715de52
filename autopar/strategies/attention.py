"""Attention family: scaled_dot_product_attention(q[..., L, E], k[..., S, E], v[..., S, Ev],
attn_mask=None, dropout_p, is_causal, scale, enable_gqa).

Each (batch, head) pair attends independently, so any dim before the last two can be split, with
q, k and v all sharded on it: dim 0 is the batch, dim 1 (of 4-d inputs) the heads (Megatron's
tensor-parallel attention). The sequence dims cannot be split without ring attention. An
attn_mask broadcasts against the [..., L, S] scores: it is sharded on its aligned dim when that
dim is full-size and replicated where it is broadcast. With enable_gqa, k/v have fewer heads:
splitting heads keeps every query head with its key/value head because both are cut into the
same number of contiguous blocks (the framework checks both head counts divide evenly).

DTensor (torch 2.13) realises this with the flash/efficient/cuDNN strategies on GPU (batch and
heads). On CPU, sdpa dispatches (without dropout) to `_scaled_dot_product_flash_attention_for_cpu`,
which has no DTensor strategy: DTensor falls back to propagating through its decomposition,
which is slow (seconds per call) and all-gathers q/k/v when a mask is given. CPU runs should
select the math backend (`torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`), where every strategy
here runs without communication; the math backend cannot run is_causal=True on DTensors (it
builds the causal mask as a plain tensor), so CPU codegen should pass an explicit mask.

sdpa is linear in v, but no DTensor kernel strategy accepts a Partial v: not offered.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import REPLICATE, shard
from autopar.strategies.pointwise import call_arg

_ROLE = {0: "batch", 1: "heads"}


@register("aten.scaled_dot_product_attention.default")
def scaled_dot_product_attention(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if tuple(node.args[:3]) != (Ref(index=0), Ref(index=1), Ref(index=2)):
        return []
    has_mask = isinstance(call_arg(node, 3, "attn_mask"), Ref)
    query, key = inputs[0], inputs[1]
    rank = len(query.shape)
    if len(key.shape) != rank or len(inputs) != 3 + has_mask:
        return []
    strategies = []
    for dim in range(rank - 2):
        placements = (shard(dim),) * 3
        if has_mask:
            placements += (_mask_placement(inputs[3], dim, query, key),)
        strategies.append(Strategy1D(inputs=placements, output=shard(dim), split=True,
                                     name=_ROLE.get(dim, f"dim{dim}")))
    return strategies


def _mask_placement(mask: TensorMeta, dim: int, query: TensorMeta, key: TensorMeta) -> str:
    """The mask broadcasts against scores [..., L, S] (aligned from the right)."""
    scores_rank = len(query.shape)
    mask_dim = dim - (scores_rank - len(mask.shape))
    if mask_dim >= 0 and mask.shape[mask_dim] == query.shape[dim] and mask.shape[mask_dim] > 1:
        return shard(mask_dim)
    return REPLICATE


# --- context parallelism: the sequence split over a cp axis ---------------------------------------

ATTENTION_TARGET = "aten.scaled_dot_product_attention.default"


def attention_nodes(graph) -> list[OpNode]:
    """The scaled-dot-product attention ops of a graph (the ops context parallelism replaces)."""
    return [node for node in graph.calls() if node.target == ATTENTION_TARGET]


def is_causal(node: OpNode) -> bool:
    return bool(call_arg(node, 5, "is_causal"))


_RESHAPES = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")


def kv_repeats(graph, node: OpNode) -> int:
    """r when sdpa's K and V are their kv heads each repeated r times in place (grouped-query
    attention written without `enable_gqa`: `repeat_interleave(r, dim=heads)`, or Hugging Face's
    repeat_kv, an expand to (b, kv, r, s, d) reshaped to (b, kv r, s, d)); else 1.

    Heads h r .. h r + r - 1 are then copies of kv head h, so every r-th head is the kv-head
    tensor itself: context parallelism gathers only those and attends with `enable_gqa`."""
    factors = {_repeat_factor(graph, graph[node.inputs[index]]) for index in (1, 2) if index < len(node.inputs)}
    return factors.pop() if len(factors) == 1 else 1


def _repeat_factor(graph, producer: OpNode) -> int:
    if producer.kind != "call" or len(producer.output.shape) != 4 or not producer.inputs:
        return 1
    source = graph[producer.inputs[0]].output
    if producer.target == "aten.repeat_interleave.self_int" and producer.args[:1] == (Ref(index=0),):
        repeats, dim = call_arg(producer, 1, "repeats"), call_arg(producer, 2, "dim")
        if isinstance(repeats, int) and dim in (1, -3) and source.shape[1] * repeats == producer.output.shape[1]:
            return repeats
        return 1
    if producer.target in _RESHAPES:
        expand = graph[producer.inputs[0]]
        if expand.kind == "call" and expand.target == "aten.expand.default" and expand.inputs:
            grouped = expand.output.shape  # (b, kv, r, s, d) from (b, kv, 1, s, d)
            before = graph[expand.inputs[0]].output.shape
            if (len(grouped) == 5 and len(before) == 5 and before[2] == 1
                    and (grouped[0], grouped[1] * grouped[2], *grouped[3:]) == producer.output.shape):
                return grouped[2]
    return 1


def context_parallel_blocker(graph, sequence_length: int) -> str:
    """Why the sequence of `graph` cannot be split over ranks ("" when it can).

    Under context parallelism every op but attention works position by position: the only ops
    that may see two sequence positions at once are sdpa's, run causal or unmasked (the runtime
    builds the causal mask of the global positions; an explicit mask would have to be split
    with the keys). Anything else that multiplies two activations (the scores of a hand-written
    attention) mixes positions that would live on
    other ranks. (Other position-mixing ops, a convolution or cumulative sum along the sequence,
    are not detected.)"""
    if sequence_length <= 1:
        return "the model has no token sequence (an integer input of shape (batch, seq))"
    attentions = attention_nodes(graph)
    if not attentions:
        return "the model has no scaled_dot_product_attention op (hand-written attention cannot be split)"
    for node in attentions:
        query, key = graph[node.inputs[0]].output, graph[node.inputs[1]].output
        if query.shape[-2] != sequence_length or key.shape[-2] != sequence_length:
            return (f"attention {node.name} attends {query.shape[-2]} queries to {key.shape[-2]} keys, not the "
                    f"{sequence_length} tokens of the sequence (cross-attention is not split)")
        if isinstance(call_arg(node, 3, "attn_mask"), Ref):
            return f"attention {node.name} takes an explicit attn_mask (only causal or unmasked attention is split)"
    from_inputs = _input_dependent(graph)
    for node in graph.calls():
        if node.target.startswith(_MATMULS) and \
                sum(1 for source in dict.fromkeys(node.inputs) if source in from_inputs) >= 2:
            return (f"op {node.name} ({node.target}) multiplies two activations (a hand-written attention's "
                    "scores?), which mixes sequence positions outside scaled_dot_product_attention")
    return ""


_MATMULS = ("aten.matmul", "aten.bmm", "aten.mm", "aten.einsum", "aten.baddbmm", "aten.addmm", "aten.addbmm")


def _input_dependent(graph) -> set[str]:
    """Nodes whose value depends on a model input (activations, not weights or tables)."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.kind in ("input", "target") or (node.kind == "call" and any(source in found for source in node.inputs)):
            found.add(node.name)
    return found

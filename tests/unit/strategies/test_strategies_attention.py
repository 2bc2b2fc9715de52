"""Attention family: batch and heads on q, k, v (and a broadcastable mask), never the sequence."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

Q, K, V, MASK = (Ref(index=k) for k in range(4))


def _offered(shapes: list, args: tuple, kwargs: tuple = ()) -> dict:
    metas = [TensorMeta(shape=shape, dtype="float32") for shape in shapes]
    output = TensorMeta(shape=shapes[0][:-1] + shapes[2][-1:], dtype="float32")
    node = OpNode(name="sdpa", kind="call", target="aten.scaled_dot_product_attention.default",
                  inputs=tuple(f"in{k}" for k in range(len(metas))), args=args, kwargs=kwargs, outputs=(output,))
    return {strategy.name: (strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, 4)}


def test_batch_and_heads_without_mask() -> None:
    offered = _offered([(4, 8, 16, 8)] * 3, (Q, K, V), (("is_causal", True),))
    assert offered == {"replicate": (("R",) * 3, "R"), "batch": (("S0",) * 3, "S0"), "heads": (("S1",) * 3, "S1")}


def test_mask_is_sharded_where_it_is_full_size_and_replicated_where_broadcast() -> None:
    per_sample = _offered([(4, 8, 16, 8)] * 3 + [(4, 1, 16, 16)], (Q, K, V, MASK, 0.1))
    assert per_sample["batch"] == (("S0", "S0", "S0", "S0"), "S0")
    assert per_sample["heads"] == (("S1", "S1", "S1", "R"), "S1")
    shared = _offered([(4, 8, 16, 8)] * 3 + [(16, 16)], (Q, K, V), (("attn_mask", MASK),))
    assert shared["batch"][0][3] == "R" and shared["heads"][0][3] == "R"


def test_grouped_query_heads_split_when_both_head_counts_divide() -> None:
    offered = _offered([(4, 8, 16, 8), (4, 4, 16, 8), (4, 4, 16, 8)], (Q, K, V), (("enable_gqa", True),))
    assert offered["heads"] == (("S1",) * 3, "S1")
    too_few = _offered([(4, 8, 16, 8), (4, 2, 16, 8), (4, 2, 16, 8)], (Q, K, V), (("enable_gqa", True),))
    assert "heads" not in too_few


def test_three_dim_inputs_split_only_the_batch() -> None:
    assert set(_offered([(8, 16, 8)] * 3, (Q, K, V))) == {"replicate", "batch"}

"""Embedding family: batch (any indices dim), hidden (column) and vocab (row, Partial) splits."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d


def _offered(weight: tuple, indices: tuple, axis_size: int = 4) -> dict:
    metas = [TensorMeta(shape=weight, dtype="float32"), TensorMeta(shape=indices, dtype="int64")]
    output = TensorMeta(shape=indices + weight[1:], dtype="float32")
    node = OpNode(name="embedding", kind="call", target="aten.embedding.default", inputs=("weight", "ids"),
                  args=(Ref(index=0), Ref(index=1)), outputs=(output,))
    return {strategy.name: (strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, axis_size)}


def test_all_three_splits_are_offered() -> None:
    offered = _offered((128, 64), (4, 16))
    assert offered["batch"] == (("R", "S0"), "S0")
    assert offered["dim1"] == (("R", "S1"), "S1")
    assert offered["hidden"] == (("S1", "R"), "S2")
    assert offered["vocab"] == (("S0", "R"), "P")


def test_a_vocab_that_does_not_divide_is_filtered() -> None:
    offered = _offered((50257, 64), (4, 16))
    assert "vocab" not in offered and "hidden" in offered


def test_swapped_arguments_get_no_rule() -> None:
    metas = [TensorMeta(shape=(4, 16), dtype="int64"), TensorMeta(shape=(128, 64), dtype="float32")]
    node = OpNode(name="embedding", kind="call", target="aten.embedding.default", inputs=("ids", "weight"),
                  args=(Ref(index=1), Ref(index=0)), outputs=(TensorMeta(shape=(4, 16, 64), dtype="float32"),))
    assert [strategy.name for strategy in strategies_1d(node, metas, 4)] == ["replicate"]

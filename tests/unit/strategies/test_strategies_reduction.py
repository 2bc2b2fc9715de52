"""Reduction family: sums give P over sharded dims, other reductions never shard a reduced dim,
softmax/cumsum/topk never shard the dim they work along."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

X = Ref(index=0)


def _offered(target: str, args: tuple, shape: tuple, out_shape: tuple, kwargs: tuple = (),
             num_outputs: int = 1) -> dict[str, str]:
    """{input placement: output placement} offered on an axis of 4."""
    meta = TensorMeta(shape=shape, dtype="float32")
    node = OpNode(name="node", kind="call", target=target, inputs=("x",), args=args, kwargs=kwargs,
                  outputs=(TensorMeta(shape=out_shape, dtype="float32"),) * num_outputs)
    return {strategy.inputs[0]: strategy.output for strategy in strategies_1d(node, [meta], 4)}


def test_sum_over_a_sharded_dim_is_partial_and_kept_dims_shift() -> None:
    assert _offered("aten.sum.dim_IntList", (X, [1]), (4, 8, 16), (4, 16)) == {
        "R": "R", "S0": "S0", "S1": "P", "S2": "S1", "P": "P"}
    assert _offered("aten.sum.dim_IntList", (X, [-1], True), (4, 8, 16), (4, 8, 1))["S1"] == "S1"
    assert _offered("aten.sum.default", (X,), (4, 8), ()) == {"R": "R", "S0": "P", "S1": "P", "P": "P"}


def test_mean_over_a_sharded_dim_is_partial_but_never_takes_a_partial() -> None:
    offered = _offered("aten.mean.dim", (X, [-1], True), (4, 8, 16), (4, 8, 1))
    assert offered == {"R": "R", "S0": "S0", "S1": "S1", "S2": "P"}


def test_max_like_reductions_never_shard_the_reduced_dim() -> None:
    assert _offered("aten.amax.default", (X, [-1], True), (4, 8, 16), (4, 8, 1)) == {"R": "R", "S0": "S0", "S1": "S1"}
    assert _offered("aten.max.dim", (X, 1), (4, 8, 16), (4, 16), num_outputs=2) == {"R": "R", "S0": "S0", "S2": "S1"}
    assert _offered("aten.argmax.default", (X,), (4, 8), ()) == {"R": "R"}
    variance = _offered("aten.var.correction", (X, [1]), (4, 8), (4, 1), kwargs=(("correction", 1), ("keepdim", True)))
    assert variance == {"R": "R", "S0": "S0"}


def test_softmax_never_shards_the_softmax_dim() -> None:
    assert _offered("aten.softmax.int", (X, -1), (4, 4, 8, 8), (4, 4, 8, 8)) == {
        "R": "R", "S0": "S0", "S1": "S1", "S2": "S2"}
    assert "S1" not in _offered("aten._log_softmax.default", (X, 1, False), (4, 8, 16), (4, 8, 16))


def test_scans_and_ranking_never_shard_their_dim() -> None:
    assert _offered("aten.cumsum.default", (X, -1), (4, 16), (4, 16)) == {"R": "R", "S0": "S0"}
    topk = _offered("aten.topk.default", (X, 2), (4, 8, 8), (4, 8, 2), num_outputs=2)
    assert topk == {"R": "R", "S0": "S0", "S1": "S1"}
    sort = _offered("aten.sort.stable", (X,), (4, 8), (4, 8), kwargs=(("stable", True), ("dim", 0)), num_outputs=2)
    assert sort == {"R": "R", "S1": "S1"}

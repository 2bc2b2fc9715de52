"""Norm family: never the normalized dims, never Partial, affine parameters replicated."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

X, W, B = Ref(index=0), Ref(index=1), Ref(index=2)


def _offered(target: str, args: tuple, shapes: list, axis_size: int = 4) -> set:
    metas = [TensorMeta(shape=shape, dtype="float32") for shape in shapes]
    node = OpNode(name="node", kind="call", target=target, inputs=tuple(f"in{k}" for k in range(len(metas))),
                  args=args, outputs=(metas[0],))
    return {(strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, axis_size)}


def test_layer_norm_shards_leading_dims_only() -> None:
    offered = _offered("aten.layer_norm.default", (X, [64], W, B, 1e-5, False), [(4, 8, 64), (64,), (64,)])
    assert offered == {(("R", "R", "R"), "R"), (("S0", "R", "R"), "S0"), (("S1", "R", "R"), "S1")}


def test_layer_norm_over_two_dims_keeps_both_whole() -> None:
    offered = _offered("aten.layer_norm.default", (X, [8, 64]), [(4, 8, 64)])
    assert offered == {(("R",), "R"), (("S0",), "S0")}


def test_rms_norm_matches_layer_norm() -> None:
    offered = _offered("aten.rms_norm.default", (X, [64], W, 1e-6), [(4, 8, 64), (64,)])
    assert offered == {(("R", "R"), "R"), (("S0", "R"), "S0"), (("S1", "R"), "S1")}


def test_group_norm_splits_the_batch_and_batch_norm_the_channels() -> None:
    group = _offered("aten.group_norm.default", (X, 2, W, B), [(4, 8, 4, 4), (8,), (8,)])
    assert group == {(("R", "R", "R"), "R"), (("S0", "R", "R"), "S0")}
    batch = _offered("aten.batch_norm.default", (X, W, B, Ref(index=3), Ref(index=4), True, 0.1, 1e-5, False),
                     [(2, 8, 4, 4), (8,), (8,), (8,), (8,)])
    assert batch == {(("R",) * 5, "R"), (("S1", "S0", "S0", "S0", "S0"), "S1")}


def test_not_divisible_leading_dims_are_filtered() -> None:
    offered = _offered("aten.layer_norm.default", (X, [64]), [(6, 17, 64)])
    assert offered == {(("R",), "R")}

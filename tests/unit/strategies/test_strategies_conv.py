"""Convolution family: batch only (what DTensor implements); pooling: batch or channels."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d


def _offered(target: str, args: tuple, shapes: list, output: tuple) -> dict:
    metas = [TensorMeta(shape=shape, dtype="float32") for shape in shapes]
    node = OpNode(name="node", kind="call", target=target, inputs=tuple(f"in{k}" for k in range(len(metas))),
                  args=args, outputs=(TensorMeta(shape=output, dtype="float32"),))
    return {strategy.name: (strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, 4)}


def test_conv2d_splits_only_the_batch() -> None:
    offered = _offered("aten.conv2d.default", (Ref(index=0), Ref(index=1), Ref(index=2), [2, 2]),
                       [(8, 16, 8, 8), (32, 16, 2, 2), (32,)], (8, 32, 4, 4))
    assert offered == {"replicate": (("R", "R", "R"), "R"), "batch": (("S0", "R", "R"), "S0")}


def test_unbatched_conv_is_replicated() -> None:
    offered = _offered("aten.conv1d.default", (Ref(index=0), Ref(index=1)), [(16, 8), (32, 16, 3)], (32, 6))
    assert set(offered) == {"replicate"}


def test_pooling_splits_batch_or_channels() -> None:
    offered = _offered("aten.max_pool2d.default", (Ref(index=0), [2, 2]), [(4, 8, 8, 8)], (4, 8, 4, 4))
    assert offered["batch"] == (("S0",), "S0") and offered["channels"] == (("S1",), "S1")

"""Loss family: split samples; reduced losses are P, unreduced keep the split. Cross-entropy may also
split the classes (a vocabulary-parallel loss: replicated, with its own all-reduces)."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

X, T, W = Ref(index=0), Ref(index=1), Ref(index=2)


def _offered(target: str, args: tuple, inputs: list, output: tuple = (), kwargs: tuple = ()) -> set:
    metas = [TensorMeta(shape=shape, dtype=dtype) for shape, dtype in inputs]
    node = OpNode(name="loss", kind="call", target=target, inputs=tuple(f"in{k}" for k in range(len(metas))),
                  args=args, kwargs=kwargs, outputs=(TensorMeta(shape=output, dtype="float32"),))
    return {(strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, 4)}


LOGITS, TARGETS = ((8, 128), "float32"), ((8,), "int64")


def test_cross_entropy_splits_the_batch_into_a_partial_loss() -> None:
    offered = _offered("aten.cross_entropy_loss.default", (X, T), [LOGITS, TARGETS])
    assert offered == {(("R", "R"), "R"), (("S0", "S0"), "P"), (("S1", "R"), "R")}


def test_cross_entropy_over_a_sequence_may_split_it_or_the_classes() -> None:
    offered = _offered("aten.cross_entropy_loss.default", (X, T), [((4, 128, 16), "float32"), ((4, 16), "int64")])
    assert offered == {(("R", "R"), "R"), (("S0", "S0"), "P"), (("S2", "S1"), "P"), (("S1", "R"), "R")}


def test_vocab_parallel_cross_entropy_prices_its_three_row_all_reduces() -> None:
    """The row maxima and sums of exponentials in fp32, the target's logit in the logits' dtype."""
    metas = [TensorMeta(shape=(4, 1000, 16), dtype="bfloat16"), TensorMeta(shape=(4, 16), dtype="int64")]
    node = OpNode(name="loss", kind="call", target="aten.cross_entropy_loss.default", inputs=("in0", "in1"),
                  args=(X, T), kwargs=(), outputs=(TensorMeta(shape=(), dtype="float32"),))
    vocab = [strategy for strategy in strategies_1d(node, metas, 4) if strategy.name == "vocab"]
    assert len(vocab) == 1 and vocab[0].split
    rows = 4 * 16
    assert vocab[0].collectives == (("all_reduce", "fwd", 4.0 * rows),) * 2 + (("all_reduce", "fwd", 2.0 * rows),)
    nll = OpNode(name="loss", kind="call", target="aten.nll_loss_nd.default", inputs=("in0", "in1"),
                 args=(X, T), kwargs=(), outputs=(TensorMeta(shape=(), dtype="float32"),))
    assert not any(strategy.name == "vocab" for strategy in strategies_1d(nll, metas, 4))


def test_unreduced_loss_keeps_the_split() -> None:
    offered = _offered("aten.cross_entropy_loss.default", (X, T, None, 0), [LOGITS, TARGETS], (8,))
    assert (("S0", "S0"), "S0") in offered


def test_class_weights_with_mean_or_label_smoothing_are_not_split() -> None:
    weighted = _offered("aten.cross_entropy_loss.default", (X, T, W), [LOGITS, TARGETS, ((128,), "float32")])
    assert weighted == {(("R", "R", "R"), "R")}
    weighted_sum = _offered("aten.cross_entropy_loss.default", (X, T, W, 2), [LOGITS, TARGETS, ((128,), "float32")])
    assert (("S0", "S0", "R"), "P") in weighted_sum and (("S1", "R", "R"), "R") in weighted_sum
    smoothed = _offered("aten.cross_entropy_loss.default", (X, T, None, 1, -100, 0.1), [LOGITS, TARGETS])
    assert smoothed == {(("R", "R"), "R")}


def test_elementwise_losses_split_any_dim() -> None:
    offered = _offered("aten.mse_loss.default", (X, T), [((4, 8), "float32"), ((4, 8), "float32")])
    assert offered == {(("R", "R"), "R"), (("S0", "S0"), "P"), (("S1", "S1"), "P")}
    unreduced = _offered("aten.mse_loss.default", (X, T, 0), [((4, 8), "float32")] * 2, (4, 8))
    assert (("S1", "S1"), "S1") in unreduced

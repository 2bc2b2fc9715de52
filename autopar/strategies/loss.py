"""Loss family: cross_entropy / nll_loss (class-index targets) and elementwise losses (mse, l1,
smooth_l1, huber, binary_cross_entropy[_with_logits], kl_div).

Samples (and, for elementwise losses, every element) are independent, so every dim but the
class dim can be split, with the input and target sharded alike. With reduction="none" the
output keeps that sharding; with "sum" or "mean" it is P. What DTensor does (torch 2.13):

  - "mean" gives Partial("avg"), reported as P: exact because the framework keeps only even
    shards, BUT for cross_entropy/nll_loss the local mean divides by the local count of targets
    that are not ignore_index: if ignored targets are spread unevenly over the devices, DTensor's
    loss differs from one device's. DTensor's own rule accepts this.
  - cross_entropy with class weights and reduction="mean" returns a wrong value (the weighted mean
    of local weighted means): not offered. With label_smoothing > 0 DTensor all-reduces inside
    the op: not offered either.
  - cross_entropy may also split the class dim (a vocabulary-parallel loss, as Megatron-LM's and
    torchtitan's): logits sharded by class, target replicated, a replicated loss. It is DTensor's
    `loss_parallel` (torch/distributed/tensor/parallel/loss.py), which codegen runs around the
    loss alone (codegen/loss_parallel.py): its forward all-reduces each row's maximum and sum of
    exponentials (fp32) and the target's logit (the input's dtype); its backward communicates
    nothing. Not with class weights under "mean" or label smoothing, as above.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard
from autopar.strategies.pointwise import broadcast_shape, broadcast_strategies, call_arg

NONE, MEAN = 0, 1
"""torch's Reduction enum values; SUM is 2."""
CLASS_LOSSES = {"aten.cross_entropy_loss.default": 3, "aten.nll_loss.default": 3, "aten.nll_loss_nd.default": 3,
                "aten.nll_loss2d.default": 3}
"""Target -> position of the reduction argument."""
ELEMENTWISE_LOSSES = {"aten.mse_loss.default": 2, "aten.l1_loss.default": 2, "aten.smooth_l1_loss.default": 2,
                      "aten.huber_loss.default": 2, "aten.kl_div.default": 2, "aten.soft_margin_loss.default": 2,
                      "aten.binary_cross_entropy.default": 3, "aten.binary_cross_entropy_with_logits.default": 4}


def _reduction(node: OpNode, position: int) -> int:
    return call_arg(node, position, "reduction", MEAN)


def _reduced(strategies: list[Strategy1D], reduction: int) -> list[Strategy1D]:
    """Reduced losses sum (or average) over the split samples: P."""
    if reduction == NONE:
        return strategies
    return [Strategy1D(inputs=strategy.inputs, output=PARTIAL, split=True, name=strategy.name)
            for strategy in strategies]


@register(*CLASS_LOSSES)
def class_loss(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """input [N, C, d1...] (or [C]) and class indices target [N, d1...]: split any dim but C."""
    if len(inputs) < 2 or tuple(node.args[:2]) != (Ref(index=0), Ref(index=1)) or inputs[1].is_float:
        return []
    reduction = _reduction(node, CLASS_LOSSES[node.target])
    has_weight = isinstance(call_arg(node, 2, "weight"), Ref)
    smoothing = call_arg(node, 5, "label_smoothing", 0.0) if node.target == "aten.cross_entropy_loss.default" else 0
    if (has_weight and reduction == MEAN) or smoothing or len(inputs[0].shape) < 2:
        return []
    strategies = []
    for dim in range(len(inputs[0].shape)):
        if dim == 1:
            continue
        target_dim = dim if dim == 0 else dim - 1
        placements = (shard(dim), shard(target_dim)) + (REPLICATE,) * (len(inputs) - 2)
        strategies.append(Strategy1D(inputs=placements, output=shard(target_dim), split=True,
                                     name="batch" if dim == 0 else f"dim{dim}"))
    strategies = _reduced(strategies, reduction)
    if node.target == "aten.cross_entropy_loss.default":
        strategies.append(_vocab_parallel(inputs))
    return strategies


VOCAB = "vocab"
"""The name of the class-sharded cross-entropy strategy (plans record whether it was chosen)."""


def _vocab_parallel(inputs: Sequence[TensorMeta]) -> Strategy1D:
    """Logits sharded on the class dim: each device works on its classes; three all-reduces of
    one value per row (maximum, sum of exponentials, the target's logit) make the loss whole.

    DTensor runs it as decomposed ops (loss.py's _log_softmax, _nll_loss_and_log_softmax_backward),
    not aten's fused kernels, and its backward holds one temporary more: zeros_like(x) with the
    targets scattered in, exp(x) and their sum at once beside the saved log-probabilities, where
    aten's nll_loss and log_softmax backward hold two gradients. Measured (resident memory, fp32
    logits of L bytes, benchmarks/vocab_parallel_loss.py --memory): fused forward 2 L and backward
    3 L at their peaks, loss_parallel 3 L and 4 L."""
    logits = inputs[0]
    rows = logits.numel // logits.shape[1]
    fp32 = ("all_reduce", "fwd", 4.0 * rows)
    collectives = (fp32, fp32, ("all_reduce", "fwd", float(logits.itemsize_bytes * rows)))
    placements = (shard(1),) + (REPLICATE,) * (len(inputs) - 1)
    return Strategy1D(inputs=placements, output=REPLICATE, split=True, name=VOCAB, collectives=collectives,
                      backward_copies=1.0)


@register(*ELEMENTWISE_LOSSES)
def elementwise_loss(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Pointwise on broadcast inputs, then reduced: split any dim of the broadcast shape."""
    if not inputs:
        return []
    strategies = broadcast_strategies(inputs, broadcast_shape(inputs))
    return _reduced(strategies, _reduction(node, ELEMENTWISE_LOSSES[node.target]))

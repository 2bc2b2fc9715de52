"""Normalization family: layer_norm, rms_norm, group_norm, batch_norm.

A norm computes statistics over some dims and scales by them, so only the dims it does not
normalize over can be sharded, and its affine parameters are replicated (DTensor, torch 2.13,
`_math_ops.py`):

  - layer_norm / rms_norm: any leading dim (before the normalized_shape dims).
  - group_norm: the batch dim only (statistics mix channels and space within a sample).
  - batch_norm: the channel dim only (statistics are over batch and space); its weight, bias and
    running statistics are then sharded with the channels.

Norms are not linear, so they never take a Partial input.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import REPLICATE, shard
from autopar.strategies.pointwise import call_arg

LAYER_NORMS = ("aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default",
               "aten._fused_rms_norm.default")
GROUP_NORMS = ("aten.group_norm.default", "aten.native_group_norm.default")
BATCH_NORMS = ("aten.batch_norm.default",)
"""Not native_batch_norm: its saved statistics [C] would need S0 while its output takes S1, and
a Strategy1D gives every output one placement."""


def _input_first(node: OpNode) -> bool:
    """The normalized tensor is the first call argument and the first tensor input."""
    return bool(node.args) and node.args[0] == Ref(index=0)


def sharded_input_strategy(num_inputs: int, dim: int, name: str, others: str = REPLICATE) -> Strategy1D:
    """The normalized tensor (input 0) and the output sharded on `dim`; the rest `others`."""
    return Strategy1D(inputs=(shard(dim),) + (others,) * (num_inputs - 1), output=shard(dim), split=True,
                      name=name)


@register(*LAYER_NORMS)
def layer_norm(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if not _input_first(node):
        return []
    rank = len(inputs[0].shape)
    normalized = call_arg(node, 1, "normalized_shape")
    num_leading = rank - len(normalized)
    return [sharded_input_strategy(len(inputs), dim, "batch" if dim == 0 else f"dim{dim}")
            for dim in range(num_leading)]


@register(*GROUP_NORMS)
def group_norm(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if not _input_first(node):
        return []
    return [sharded_input_strategy(len(inputs), 0, "batch")]


@register(*BATCH_NORMS)
def batch_norm(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Channels (dim 1 of the input, dim 0 of every per-channel tensor) split across devices."""
    if not _input_first(node) or len(inputs[0].shape) < 2:
        return []
    strategy = Strategy1D(inputs=(shard(1),) + (shard(0),) * (len(inputs) - 1), output=shard(1), split=True,
                          name="channels")
    return [strategy]

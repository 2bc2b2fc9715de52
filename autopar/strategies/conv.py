"""Convolution and pooling family: conv1d/2d/3d (input[N, C, *spatial], weight[O, C/groups, *kernel],
bias[O]), max/avg/adaptive pooling.

Mathematically a convolution can also split its output channels (weight and bias sharded on
dim 0, output on dim 1) or contract its input channels (input and weight sharded on dim 1,
output Partial). DTensor (torch 2.13, `_conv_ops.py`) implements only the batch split: its
convolution rule takes the output placement from the input alone, so with a sharded weight it
silently returns a WRONG tensor labelled Replicate (no error, no communication). Only "batch" is
offered for convolutions.

Pooling works on each (sample, channel) plane independently: DTensor shards batch or channels.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import REPLICATE, shard

CONVOLUTIONS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
                "aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input")
POOLS = ("aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
         "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
         "aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool3d.default",
         "aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default")


@register(*CONVOLUTIONS)
def convolution(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Batch only, and only for batched inputs (an unbatched input's dim 0 is its channels)."""
    if len(inputs) < 2 or tuple(node.args[:2]) != (Ref(index=0), Ref(index=1)):
        return []
    if len(inputs[0].shape) != len(inputs[1].shape):
        return []
    placements = (shard(0),) + (REPLICATE,) * (len(inputs) - 1)
    return [Strategy1D(inputs=placements, output=shard(0), split=True, name="batch")]


@register(*POOLS)
def pool(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Batch or channels of a batched input [N, C, *spatial]."""
    spatial_dims = int(node.target.split(".")[1][-2])
    if len(inputs) != 1 or len(inputs[0].shape) != spatial_dims + 2:
        return []
    return [Strategy1D(inputs=(shard(dim),), output=shard(dim), split=True, name=name)
            for dim, name in ((0, "batch"), (1, "channels"))]

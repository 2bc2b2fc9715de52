"""Reduction family: ops that combine elements along some dims: sum/mean/amax/var..., and the
ops that normalize, scan or rank along one dim: softmax/log_softmax, cumsum, topk/sort.

Any dim that is not reduced may stay sharded (it shifts down when keepdim=False removes the
reduced dims before it). A reduced dim may be sharded only when the partial results combine with
a sum, as DTensor's Partial does (torch 2.13, `_math_ops.py`):

  - sum over a sharded dim gives P; sum of a P input is P (the sum is linear).
  - mean over a sharded dim: DTensor gives Partial("avg"), reported here as "P" (an all-reduce
    of the same size; the avg is exact because the framework only keeps even shards). A mean of
    a P(sum) input is all-reduced first by DTensor, so it is not offered. Consumers that accept
    P are written for Partial("sum"); DTensor all-reduces a Partial("avg") before the ops that
    have no avg rule (e.g. matmul), so a plan that keeps a mean's P through them pays an
    unpriced all-reduce.
  - amax/amin/max/min/argmax/prod/var/std over a sharded dim would give Partial("max") etc. or
    need a gather: not offered.
  - softmax/log_softmax/cumsum/topk/sort: any dim but the one they work along.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, shard
from autopar.strategies.pointwise import call_arg, normalize_dim

SUMS = ("aten.sum.dim_IntList", "aten.sum.default", "aten.nansum.default")
MEANS = ("aten.mean.dim", "aten.mean.default")
OTHER_REDUCTIONS = (
    "aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim", "aten.argmax.default",
    "aten.argmin.default", "aten.prod.dim_int", "aten.any.dim", "aten.any.dims", "aten.all.dim",
    "aten.var.correction", "aten.std.correction", "aten.var_mean.correction", "aten.var.dim", "aten.std.dim",
    "aten.logsumexp.default", "aten.norm.ScalarOpt_dim", "aten.linalg_vector_norm.default",
)
ALONG_DIM = ("aten.softmax.int", "aten.log_softmax.int", "aten._softmax.default", "aten._log_softmax.default",
             "aten._safe_softmax.default", "aten.cumsum.default", "aten.cumprod.default",
             "aten.logcumsumexp.default", "aten.cummax.default", "aten.cummin.default")
RANKING = ("aten.topk.default", "aten.sort.default", "aten.sort.stable", "aten.argsort.default",
           "aten.argsort.stable")
_ARG_POSITIONS = {"aten.var.dim": (1, 3), "aten.std.dim": (1, 3), "aten.norm.ScalarOpt_dim": (2, 3),
                  "aten.linalg_vector_norm.default": (2, 3)}
"""(dims, keepdim) argument positions where they are not (1, 2)."""


def reduced_dims(node: OpNode, rank: int) -> list[int]:
    """The dims a reduction collapses (all of them when no dims are given)."""
    position = _ARG_POSITIONS.get(node.target, (1, 2))[0]
    dims = call_arg(node, position, "dim")
    if dims is None or dims == []:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted({normalize_dim(dim, rank) for dim in dims})


def keeps_dims(node: OpNode) -> bool:
    position = _ARG_POSITIONS.get(node.target, (1, 2))[1]
    return bool(call_arg(node, position, "keepdim", False))


def reduction_strategies(node: OpNode, rank: int, reduced_gives_partial: bool) -> list[Strategy1D]:
    """Kept dims stay sharded (shifted when dropped); reduced dims give P if allowed."""
    reduced = reduced_dims(node, rank)
    keepdim = keeps_dims(node)
    strategies = []
    for dim in range(rank):
        if dim in reduced:
            if reduced_gives_partial:
                strategies.append(Strategy1D(inputs=(shard(dim),), output=PARTIAL, split=True, name=f"reduce{dim}"))
            continue
        target = dim if keepdim else dim - sum(1 for other in reduced if other < dim)
        strategies.append(Strategy1D(inputs=(shard(dim),), output=shard(target), split=True, name=f"dim{target}"))
    return strategies


@register(*SUMS)
def sum_(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    strategies = reduction_strategies(node, len(inputs[0].shape), reduced_gives_partial=True)
    if node.output.is_float and inputs[0].is_float:
        strategies.append(Strategy1D(inputs=(PARTIAL,), output=PARTIAL, split=False, name="partial"))
    return strategies


@register(*MEANS)
def mean(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Over a sharded dim DTensor gives Partial("avg"), reported as P (see the module note)."""
    return reduction_strategies(node, len(inputs[0].shape), reduced_gives_partial=True)


@register(*OTHER_REDUCTIONS)
def other_reduction(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    return reduction_strategies(node, len(inputs[0].shape), reduced_gives_partial=False)


def along_dim_strategies(rank: int, dim: int) -> list[Strategy1D]:
    """Shard any dim but the one the op works along."""
    return [Strategy1D(inputs=(shard(other),), output=shard(other), split=True, name=f"dim{other}")
            for other in range(rank) if other != dim]


@register(*ALONG_DIM)
def along_dim(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    return along_dim_strategies(rank, normalize_dim(call_arg(node, 1, "dim"), rank))


@register(*RANKING)
def ranking(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """topk(x, k, dim=-1), sort(x, dim=-1) / sort(x, stable=, dim=): every output alike."""
    rank = len(inputs[0].shape)
    position = {"aten.topk.default": 2, "aten.sort.default": 1, "aten.argsort.default": 1}.get(node.target)
    dim = call_arg(node, position, "dim", -1) if position is not None else node.kwarg("dim", -1)
    return along_dim_strategies(rank, normalize_dim(dim, rank))

"""Pointwise family: ops where each output element reads only the input elements at the same
(broadcast) position: activations, arithmetic, comparisons, where/masked_fill, dropout, casts.

Sharding output dim d is legal when every input is sharded on the dim that broadcasting aligns
with d (dims align from the right) or, where that input dim is broadcast (missing or of size 1),
replicated. Partial inputs pass only through ops that are linear in them, and only where DTensor
has the rule, since codegen runs DTensor (torch 2.13, `_pointwise_ops.py`):

    add/sub    P op P -> P          (P + R is not linear: R would be added once per device)
    mul        P * R, R * P, P * scalar -> P
    div        P / R, P / scalar -> P
    neg        P -> P
    casts      P -> P when the result is floating point (DTensor all-reduces a cast to int/bool)

Where DTensor differs from the textbook rule:
  - clone(P) is all-reduced by DTensor (clone has the pointwise tag without a partial rule), so
    clone is offered shards only; contiguous/alias/detach do keep P (views.py).
  - new_ones/new_zeros/... read only the dtype/device of their input: DTensor returns a
    replicated result from an input in any placement, without communication.
  - zeros_like/ones_like/... follow a sharded input; from a Partial input the result is replicated.
  - dropout with a sharded input: DTensor would draw each shard's mask from its rank's generator;
    codegen draws the global mask and keeps the shard instead (codegen/random_ops.py), as one
    device would.
  - tril/triu are replicate-only in DTensor (its linalg rule), though their leading dims could
    be split: not registered.

This module also holds the small argument helpers (`call_arg`, `normalize_dim`) shared by the
other families.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard

NONLINEAR_UNARY = tuple(f"aten.{name}.default" for name in (
    "gelu", "silu", "relu", "relu6", "tanh", "sigmoid", "exp", "exp2", "expm1", "log", "log1p", "log2",
    "sqrt", "rsqrt", "reciprocal", "cos", "sin", "tan", "atan", "erf", "erfinv", "abs", "sign", "square",
    "floor", "ceil", "round", "trunc", "frac", "logical_not", "bitwise_not", "isnan", "isinf", "isfinite",
    "nan_to_num", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "softplus",
    "mish", "logit", "clamp", "clamp_min", "clamp_max", "clone", "dropout", "native_dropout",
)) + (
    "aten.pow.Tensor_Scalar", "aten.pow.Scalar", "aten.rsub.Scalar",
    "aten.eq.Scalar", "aten.ne.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
    "aten.remainder.Scalar", "aten.fmod.Scalar", "aten.floor_divide.Scalar", "aten.bitwise_and.Scalar",
    "aten.bitwise_or.Scalar", "aten.__and__.Scalar", "aten.__or__.Scalar",
)
NONLINEAR_NARY = (
    "aten.pow.Tensor_Tensor", "aten.maximum.default", "aten.minimum.default", "aten.atan2.default",
    "aten.eq.Tensor", "aten.ne.Tensor", "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor",
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.__xor__.Tensor", "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor", "aten.bitwise_xor.Tensor", "aten.logical_and.default", "aten.logical_or.default",
    "aten.logical_xor.default", "aten.remainder.Tensor", "aten.fmod.Tensor", "aten.floor_divide.default",
    "aten.rsub.Tensor", "aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf",
    "aten.where.Scalar", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.lerp.Scalar",
    "aten.lerp.Tensor", "aten.addcmul.default", "aten.addcdiv.default", "aten.clamp.Tensor",
    "aten.copysign.Tensor", "aten.hypot.default", "aten.xlogy.Tensor",
)
CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default")
LIKE_FACTORIES = ("aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
                  "aten.empty_like.default", "aten.rand_like.default", "aten.randn_like.default")
NEW_FACTORIES = ("aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default",
                 "aten.new_empty.default")


def normalize_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim as an index in [0, ndim) (0 for 0-dim tensors)."""
    return dim % ndim if ndim else 0


def call_arg(node: OpNode, position: int, name: str, default=None):
    """The call argument at `position`, else the keyword `name`, else `default`."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwarg(name, default)


def broadcast_shape(metas: Sequence[TensorMeta]) -> tuple[int, ...]:
    """The shape the inputs broadcast to."""
    rank = max((len(meta.shape) for meta in metas), default=0)
    shape = [1] * rank
    for meta in metas:
        for dim, size in enumerate(meta.shape, start=rank - len(meta.shape)):
            shape[dim] = size if size != 1 else shape[dim]
    return tuple(shape)


def broadcast_strategies(inputs: Sequence[TensorMeta], out_shape: Sequence[int]) -> list[Strategy1D]:
    """One strategy per output dim: each input sharded on its aligned dim, or replicated where
    that dim is broadcast."""
    strategies = []
    for dim, size in enumerate(out_shape):
        if size == 1:
            continue
        placements = tuple(_aligned_placement(meta, dim, len(out_shape), size) for meta in inputs)
        strategies.append(Strategy1D(inputs=placements, output=shard(dim), split=True, name=f"dim{dim}"))
    return strategies


def _aligned_placement(meta: TensorMeta, out_dim: int, out_rank: int, size: int) -> str:
    in_dim = out_dim - (out_rank - len(meta.shape))
    if in_dim >= 0 and meta.shape[in_dim] == size:
        return shard(in_dim)
    return REPLICATE


def partial_strategy(placements: Sequence[str]) -> Strategy1D:
    return Strategy1D(inputs=tuple(placements), output=PARTIAL, split=False, name="partial")


def _floats(metas: Sequence[TensorMeta]) -> bool:
    return all(meta.is_float for meta in metas)


@register(*NONLINEAR_UNARY, *NONLINEAR_NARY)
def pointwise(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    return broadcast_strategies(inputs, node.output.shape)


@register("aten.add.Tensor", "aten.sub.Tensor")
def add(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Sum of two partials is the partial of the sum; a scalar operand is not linear."""
    strategies = broadcast_strategies(inputs, node.output.shape)
    if len(inputs) == 2 and _floats([*inputs, node.output]):
        strategies.append(partial_strategy((PARTIAL, PARTIAL)))
    return strategies


@register("aten.mul.Tensor", "aten.mul.Scalar")
def mul(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """A product is linear in either factor while the other is replicated (or a scalar)."""
    strategies = broadcast_strategies(inputs, node.output.shape)
    if _floats([*inputs, node.output]):
        for index in range(len(inputs)):
            strategies.append(partial_strategy([PARTIAL if i == index else REPLICATE for i in range(len(inputs))]))
    return strategies


@register("aten.div.Tensor", "aten.div.Scalar")
def div(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """A quotient is linear in its numerator only (with the denominator replicated)."""
    strategies = broadcast_strategies(inputs, node.output.shape)
    if _floats([*inputs, node.output]) and call_arg(node, 0, "self") == Ref(index=0):
        strategies.append(partial_strategy([PARTIAL] + [REPLICATE] * (len(inputs) - 1)))
    return strategies


@register("aten.neg.default")
def neg(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    return broadcast_strategies(inputs, node.output.shape) + [partial_strategy((PARTIAL,))]


@register(*CASTS)
def cast(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """A cast to floating point commutes with the sum of partials (up to rounding)."""
    strategies = broadcast_strategies(inputs, node.output.shape)
    if _floats([*inputs, node.output]):
        strategies.append(partial_strategy((PARTIAL,)))
    return strategies


@register("aten.type_as.default")
def type_as(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """x.type_as(other) reads only other's dtype: other mirrors x's placement when the shapes
    agree (no redistribution for nothing), else it is replicated."""
    if len(inputs) != 2:
        return []
    mirrored = inputs[0].shape == inputs[1].shape
    strategies = []
    for strategy in cast(node, inputs[:1], axis_size):
        other = strategy.inputs[0] if mirrored else REPLICATE
        strategies.append(Strategy1D(inputs=(strategy.inputs[0], other), output=strategy.output,
                                     split=strategy.split, name=strategy.name))
    return strategies


@register(*LIKE_FACTORIES)
def like_factory(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """zeros_like(x) and friends are born with x's sharding (replicated when x is Partial)."""
    if len(inputs) != 1:
        return []
    strategies = broadcast_strategies(inputs, node.output.shape)
    return strategies + [Strategy1D(inputs=(PARTIAL,), output=REPLICATE, split=False, name="partial-in")]


@register(*NEW_FACTORIES)
def new_factory(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """x.new_ones(size) reads only x's dtype and device: x may stay in any placement."""
    if len(inputs) != 1:
        return []
    placements = [shard(dim) for dim in range(len(inputs[0].shape))] + [PARTIAL]
    return [Strategy1D(inputs=(placement,), output=REPLICATE, split=False, name="metadata-only")
            for placement in placements]

"""FLOPs of the fused attention kernels, counted the same way on every supported torch.

torch's FLOP counter learned grouped-query attention (key/value with fewer heads than the
query) only in 2.13; before, its sdpa formulas assert equal head counts and raise, and the probe
would price Llama 3's, Mistral's or Qwen's attention by its bytes alone (measured on an H200 with
torch 2.11: an 8-layer Llama 3 8B-shaped step predicted 80 ms short, the whole attention).
The count here is torch 2.13's convention, written out so that it holds on older releases too:
forward two matmuls (scores = q k^T, out = scores v), backward five (the scores recomputed,
then grad scores, grad v, grad q, grad k), each over all query heads and the full s_q x s_k
square (a causal mask is not discounted, as in torch).
"""

from __future__ import annotations

import torch

_FORWARD = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention"})
_BACKWARD = frozenset(name + "_backward" for name in _FORWARD)


def is_causal(func, args, kwargs) -> bool:
    """Whether a fused attention call masks causally (its `is_causal` argument, by schema)."""
    return bool(_argument(func, args, kwargs, "is_causal", False))


def attention_dropout(func, args, kwargs) -> float:
    """A fused attention call's dropout probability (its `dropout_p` argument, by schema; 0 if none)."""
    return float(_argument(func, args, kwargs, "dropout_p", 0.0))


def _argument(func, args, kwargs, name: str, default):
    """The value a call passed for `func`'s schema argument `name` (positional or keyword), else `default`."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[position] if position < len(args) else kwargs.get(name, default)
    return default


def attention_flops(func, args) -> float | None:
    """FLOPs of `func` if it is a fused attention kernel on [batch, heads, seq, dim] tensors, else None."""
    operands = _operands(func, args)
    if operands is None:
        return None
    name = getattr(func, "_overloadpacket", func).__name__
    query, key, value = operands
    batch, query_heads, query_len, head_dim = query.shape
    key_len, value_dim = key.shape[-2], value.shape[-1]
    pairs = batch * query_heads * query_len * key_len
    scores, weighted = 2.0 * pairs * head_dim, 2.0 * pairs * value_dim
    if name in _FORWARD:
        return scores + weighted
    return 3 * scores + 2 * weighted  # scores again, grad q, grad k; grad scores, grad v


def attention_head_dim(func, args) -> int:
    """The query head dim of a fused attention kernel (0 if `func` is none)."""
    operands = _operands(func, args)
    return int(operands[0].shape[-1]) if operands is not None else 0


def _operands(func, args):
    """(query, key, value) of a fused attention kernel on [batch, heads, seq, dim] tensors, else None."""
    name = getattr(func, "_overloadpacket", func).__name__
    if name not in _FORWARD and name not in _BACKWARD:
        return None
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    query, key, value = tensors[1:4] if name in _BACKWARD else tensors[:3]
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    return query, key, value

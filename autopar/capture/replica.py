"""A weightless copy of a model for planning: same modules, parameters on `meta`.

Planning prices the training step in the compute precision (bf16 by default) whatever dtype
the user's weights have, and must not copy or allocate the weights: the copy is made with
`copy.deepcopy` whose memo maps every parameter and buffer to an empty meta tensor. Codegen
traces the program it runs under bf16 compute on one too (compute_dtype.py).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


def meta_replica(model: nn.Module, dtype: torch.dtype | None = None, *, buffers: bool = True) -> nn.Module:
    """`model` with parameters and buffers on meta; floating ones in `dtype` when given (with
    `buffers=False`: its float32 parameters only, every buffer keeping its dtype: what a
    mixed-precision runtime computes with, compute_replica)."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in memo:
            continue
        is_param = isinstance(tensor, nn.Parameter)
        cast = tensor.is_floating_point() if buffers else is_param and tensor.dtype == torch.float32
        target = dtype if dtype is not None and cast else tensor.dtype
        empty = torch.empty_like(tensor, device="meta", dtype=target)
        if is_param:
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    return copy.deepcopy(model, memo)


def meta_inputs(values, dtype: torch.dtype | None = None):
    """Example inputs as meta tensors (floating ones in `dtype`), structure kept."""
    if isinstance(values, torch.Tensor):
        target = dtype if dtype is not None and values.is_floating_point() else values.dtype
        return torch.empty_like(values, device="meta", dtype=target)
    if isinstance(values, (list, tuple)):
        return type(values)(meta_inputs(value, dtype) for value in values)
    if isinstance(values, dict):
        return {key: meta_inputs(value, dtype) for key, value in values.items()}
    return values

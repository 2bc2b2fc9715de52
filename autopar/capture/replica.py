"""A weightless copy of a model for planning: same modules, parameters on `meta`.

Planning prices the training step in the compute precision (bf16 by default) whatever dtype
the user's weights have, and must not copy or allocate the weights: the copy is made with
`copy.deepcopy` whose memo maps every parameter and buffer to an empty meta tensor.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


def meta_replica(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """`model` with parameters and buffers on meta; floating ones in `dtype` when given."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in memo:
            continue
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        empty = torch.empty_like(tensor, device="meta", dtype=target)
        if isinstance(tensor, nn.Parameter):
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

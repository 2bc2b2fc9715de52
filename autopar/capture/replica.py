"""A weightless copy of a model for planning: same modules, parameters on `meta`.

Planning prices the training step in the compute precision (bf16 by default) whatever dtype
the user's weights have, and must not copy or allocate the weights: the copy is made with
`copy.deepcopy` whose memo maps every parameter and buffer to an empty meta tensor. Codegen
traces the program it runs under bf16 compute on a replica of fake tensors on the model's own
devices (compute_replica, compute_dtype.py).
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


def compute_replica(model: nn.Module, dtype: torch.dtype, example_inputs, example_kwargs: dict):
    """(replica, inputs, kwargs) as a mixed-precision runtime computes with them: `model` with its
    float32 parameters in `dtype` and its buffers in theirs, floating inputs in `dtype`, all fake
    tensors of one FakeTensorMode on the devices the model's tensors are on (no storage; code that
    branches on the device, as Hugging Face's MoE layers do on the CPU, takes the branch it will
    run), the model itself untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    with mode:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if id(tensor) in memo:
                continue
            is_param = isinstance(tensor, nn.Parameter)
            fake = torch.empty_like(tensor, dtype=dtype if is_param and tensor.dtype == torch.float32 else tensor.dtype)
            memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if is_param else fake

        def fake_input(value):
            return torch.empty_like(value, dtype=dtype) if value.is_floating_point() else mode.from_tensor(value)

        inputs, kwargs = _map_tensors(example_inputs, fake_input), _map_tensors(example_kwargs, fake_input)
    return copy.deepcopy(model, memo), inputs, kwargs


def _map_tensors(values, function):
    """`values` with `function` applied to each tensor in it (lists, tuples and dicts kept)."""
    if isinstance(values, torch.Tensor):
        return function(values)
    if isinstance(values, (list, tuple)):
        return type(values)(_map_tensors(value, function) for value in values)
    if isinstance(values, dict):
        return {key: _map_tensors(value, function) for key, value in values.items()}
    return values


def meta_inputs(values, dtype: torch.dtype | None = None):
    """Example inputs as meta tensors (floating ones in `dtype`), structure kept."""
    def on_meta(value: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return torch.empty_like(value, device="meta", dtype=target)

    return _map_tensors(values, on_meta)

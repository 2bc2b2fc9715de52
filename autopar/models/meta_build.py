"""Build a model on `meta` without running its weight initialization.

    with autopar.models.on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)

A model built under `torch.device("meta")` allocates nothing, but its constructors still run
every initializer (`reset_parameters`, `nn.init.normal_`, transformers' `_init_weights`) on the
empty tensors, and each call goes through torch's Python decompositions: for GPT-3 175B that
is most of the build (0.6 of 0.9 s idle) for values that do not exist. Under `on_meta()` the
random and constant initializers return a meta tensor untouched; everything else (shapes,
buffers made by factory functions, modules) runs as it would. Tensors on a real device are
initialized as usual, so a model that mixes devices is unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_INITIALIZERS = frozenset({
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.constant_, nn.init.ones_, nn.init.zeros_,
    nn.init.eye_, nn.init.dirac_, nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_uniform_,
    nn.init.kaiming_normal_, nn.init.orthogonal_, nn.init.sparse_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_,
    torch.Tensor.bernoulli_,
})
"""In-place functions that only set values (torch.nn.init's and the Tensor methods they call)."""


class _SkipInitOnMeta(TorchFunctionMode):
    """Returns a meta tensor from an initializer without running it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_init_on_meta() -> Iterator[None]:
    """Initializers of meta tensors do nothing inside (other tensors are initialized)."""
    with _SkipInitOnMeta():
        yield


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`torch.device("meta")` as the default device, without initializing the weights."""
    with torch.device("meta"), skip_init_on_meta():
        yield

"""`loss_fn` on the model's output: gathered, or with its class-sharded logits left sharded.

Without `plan.loss_parallel`, every output is gathered to whole local tensors and `loss_fn` runs
on them as on one device. With it (the planner chose the vocabulary-parallel cross-entropy,
strategies/loss.py), the outputs stay DTensors with their planned placements and `loss_fn` runs
under DTensor's `loss_parallel`, whose log_softmax / nll_loss rules work on logits sharded by
class: no all-gather of the logits, and each device holds and differentiates its share of them.
Logits that reach the cross-entropy otherwise placed (partial sums) are moved onto the class dim
at its input first, as the plan priced it.

While active, `loss_parallel` replaces the dispatch of log_softmax and nll_loss for every DTensor,
and its log_softmax backward rule returns its input unchanged (the nll_loss backward rule has done
the work). Active through a whole step, it would break any other log_softmax in the model (and it
raises on one that is not class-sharded). So it is active around the loss alone: `_ScopedLoss`
runs `loss_fn` on detached copies of the outputs in its forward and their backward in its own
backward, both inside the context. A `loss_fn` that DTensor cannot run (an op without a DTensor
rule) falls back, with a warning, to the gathered outputs; it then costs the plan an all-gather of
the logits and the whole loss on every device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel
from torch.overrides import TorchFunctionMode

from autopar.codegen.interpreter import contiguous_grad, redistribute


def replicated_local(value):
    """DTensors (also inside tuples and lists) as whole local tensors."""
    if isinstance(value, DTensor):
        return contiguous_grad(value).redistribute(value.device_mesh, [Replicate()]).to_local()
    if isinstance(value, (tuple, list)):
        return type(value)(replicated_local(item) for item in value)
    return value


def as_float(value):
    """The loss sees fp32 outputs, as `autopar.plan` traced it (bf16 compute casts them back)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


@contextmanager
def loss_parallel() -> Iterator[None]:
    """DTensor's loss_parallel, switched off again when its body raises (torch 2.13's own context
    manager leaves its rules on for every later DTensor op then), with each cross-entropy's
    logits sharded by class first (_ClassShardedLogits)."""
    context = _torch_loss_parallel()
    context.__enter__()
    try:
        with _ClassShardedLogits():
            yield
    finally:
        context.__exit__(None, None, None)


class _ClassShardedLogits(TorchFunctionMode):
    """Gives `F.cross_entropy` its logits sharded on the class dim, as the planner's vocabulary-
    parallel strategy takes them (strategies/loss.py): logits that reach the loss otherwise (the
    partial sums of a head whose weight is split on the hidden dim, a tied embedding's) are
    redistributed there, at the loss's input, which is where the plan put and priced that edge
    (a reduce-scatter of partial logits; its backward an all-gather). DTensor's loss_parallel
    would refuse them instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.cross_entropy:
            if args and isinstance(args[0], DTensor):
                args = (_class_sharded(args[0]),) + tuple(args[1:])
            elif isinstance(kwargs.get("input"), DTensor):
                kwargs["input"] = _class_sharded(kwargs["input"])
        return func(*args, **kwargs)


def _class_sharded(logits: DTensor) -> DTensor:
    """`logits` ([C] or [N, C, ...]) sharded on the class dim over its one-axis mesh."""
    class_dim = 0 if logits.dim() == 1 else 1
    if logits.device_mesh.ndim != 1 or logits.placements[0] == Shard(class_dim):
        return logits
    return redistribute(logits, f"S{class_dim}")


class ModelLoss:
    """`loss_fn(model_output(values), targets)` for one microbatch's tensor outputs `values`."""

    def __init__(self, loss_fn: Callable, model_output: Callable, *, sharded: bool) -> None:
        self.loss_fn = loss_fn
        self.model_output = model_output
        self.sharded = sharded
        """Run on the DTensor outputs under loss_parallel (False: gathered; also after a fallback)."""
        self.fallback_reason: str | None = None

    def __call__(self, values: tuple, targets) -> torch.Tensor:
        if self.sharded and any(isinstance(value, DTensor) for value in values):
            try:
                return self._sharded(values, targets)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
                self._fall_back(error)
        return self._on(replicated_local(values), targets)

    def _on(self, values: tuple, targets):
        """`loss_fn` of the model's output object rebuilt from `values` (fp32)."""
        return self.loss_fn(self.model_output(tuple(as_float(value) for value in values)), targets)

    def _sharded(self, values: tuple, targets) -> torch.Tensor:
        def run(inner: tuple):
            return self._on(inner, targets)

        if not torch.is_grad_enabled():
            with loss_parallel():
                return _whole(run(values))
        return _ScopedLoss.apply(run, *values)

    def _fall_back(self, error: BaseException) -> None:
        self.sharded = False
        self.fallback_reason = f"{type(error).__name__}: {error}"
        warnings.warn("autopar: loss_fn could not run on the class-sharded logits under DTensor's loss_parallel "
                      f"({self.fallback_reason}); the logits are gathered for the loss from now on, which the plan "
                      "did not price (re-plan with this loss_fn, or write it with F.cross_entropy on the logits)",
                      RuntimeWarning, stacklevel=3)


class _ScopedLoss(torch.autograd.Function):
    """The loss of `run(values)` computed, and differentiated, inside loss_parallel only."""

    @staticmethod
    def forward(ctx, run: Callable, *values):
        with torch.enable_grad():
            inner = tuple(_detached(value) for value in values)
            with loss_parallel():
                loss = run(inner)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a one-element tensor, got {type(loss).__name__}")
        ctx.inner, ctx.loss = inner, loss
        return _whole(loss).detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss, inner = ctx.loss, ctx.inner
        if isinstance(loss, DTensor):
            grad = DTensor.from_local(grad, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
        wanted = [value for value in inner if _needs_grad(value)]
        with loss_parallel():
            grads = iter(torch.autograd.grad(loss, wanted, grad, allow_unused=True) if wanted else ())
        ctx.inner = ctx.loss = None
        return (None,) + tuple(next(grads) if _needs_grad(value) else None for value in inner)


def _detached(value):
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def _needs_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _whole(loss):
    """The loss as a plain tensor (loss_parallel's is replicated over the tensor-parallel mesh)."""
    if isinstance(loss, DTensor):
        return loss.full_tensor()
    return loss

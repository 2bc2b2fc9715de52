"""Gradient accumulation into the fp32 gradients of mixed precision's bf16 weight copies.

A bf16 plan keeps fp32 parameters and computes with bf16 copies made once per step
(program.WeightCasts). With a plain cast (`weight.to(bf16)`) each microbatch's backward runs two
passes over every weight gradient: autograd's cast of the bf16 gradient to fp32 (read 2 bytes,
write 4) and AccumulateGrad's add of that into `.grad` (read 4 + 4, write 4). The copy made here
accumulates instead, as Megatron-LM's fp32 `main_grad` buffer does: its backward adds the bf16
gradient straight into the fp32 `.grad` in one kernel (`add_` promotes bf16 to fp32 element by
element: read 2 + 4 bytes, write 4), the first microbatch's is the cast itself, and autograd gets
no gradient to accumulate. The values are those of the cast and the add (fp32 accumulation of the
same bf16 gradients), and `.grad` keeps its meaning (a step adds to what is there).

A linear reading the copy can do better still: codegen/fused_wgrad.py accumulates its weight
gradient inside the weight-gradient GEMM (CUDA), and this cast then gets no gradient from it.

torch's zero-bubble schedules compute weight gradients with `autograd.grad` to the weights and add
them themselves (pipelining/_backward.stage_backward_weight), so they keep the plain cast.
"""

from __future__ import annotations

import torch


class AccumulatingCast(torch.autograd.Function):
    """`weight.to(dtype)` whose backward adds the gradient into `weight.grad` in the weight's
    dtype (one fused kernel) and returns none to autograd."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight
        return weight.detach().to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        accumulate_into_grad(ctx.weight, grad)
        return None, None


@torch.no_grad()
def accumulate_into_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """`weight.grad += grad` in the weight's dtype; the first gradient is cast into place."""
    if weight.grad is None:
        weight.grad = grad.to(weight.dtype)
    else:
        weight.grad.add_(grad)


def accumulating_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `dtype` copy of `weight` whose gradients accumulate into `weight.grad` (AccumulatingCast)."""
    if not weight.requires_grad or not torch.is_grad_enabled():
        return weight.to(dtype)
    return AccumulatingCast.apply(weight, dtype)

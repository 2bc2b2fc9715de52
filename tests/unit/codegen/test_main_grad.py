"""Gradient accumulation of bf16 weight copies straight into the fp32 gradients (main_grad.py)."""

import torch

from autopar.codegen.main_grad import AccumulatingCast, accumulating_copy
from autopar.codegen.program import WeightCasts


def _microbatches(count: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(5, 4) for _ in range(count)]


def _loss(inputs: torch.Tensor, weight_copy: torch.Tensor) -> torch.Tensor:
    return (inputs.bfloat16() @ weight_copy.t()).float().pow(2).sum()


def test_the_copy_accumulates_as_a_cast_and_autograds_add_would_and_keeps_what_grad_held():
    """Over several microbatches the fp32 .grad equals autograd's cast-then-accumulate bit for bit,
    including a gradient left in .grad before the step."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    reference = torch.nn.Parameter(weight.detach().clone())
    weight.grad = torch.full_like(weight, 0.5)
    reference.grad = torch.full_like(reference, 0.5)
    casts = WeightCasts()
    with casts.step([(weight, torch.bfloat16)]):
        for inputs in _microbatches():
            _loss(inputs, casts.cast(weight, torch.bfloat16)).backward()
    for inputs in _microbatches():
        _loss(inputs, reference.to(torch.bfloat16)).backward()
    assert weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, reference.grad)
    assert casts.num_casts == 1


def test_autograd_gets_no_gradient_to_accumulate():
    """The copy's backward writes .grad itself: autograd's own accumulation never runs (no second
    pass), and autograd.grad to the weight sees none."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    copy = AccumulatingCast.apply(weight, torch.bfloat16)
    assert copy.dtype == torch.bfloat16 and copy.requires_grad
    (handed,) = torch.autograd.grad(_loss(_microbatches(1)[0], copy), weight, allow_unused=True)
    assert handed is None and weight.grad is not None and weight.grad.dtype == torch.float32


def test_without_autograd_the_copy_is_a_plain_cast():
    weight = torch.nn.Parameter(torch.randn(3, 4))
    with torch.no_grad():
        copy = accumulating_copy(weight, torch.bfloat16)
    assert copy.grad_fn is None and torch.equal(copy, weight.detach().to(torch.bfloat16))


def test_zero_bubble_plans_keep_the_plain_cast():
    """torch's zero-bubble weight pass asks autograd.grad for the weights' gradients: their copies
    must hand autograd a gradient."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    casts = WeightCasts(accumulate_into_grad=False)
    with casts.step([(weight, torch.bfloat16)]):
        copy = casts.cast(weight, torch.bfloat16)
        (grad,) = torch.autograd.grad(_loss(_microbatches(1)[0], copy), weight)
    assert grad.dtype == torch.float32 and weight.grad is None

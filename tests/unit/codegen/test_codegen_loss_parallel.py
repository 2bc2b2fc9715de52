"""codegen/loss_parallel.py on a one-process mesh: the loss on class-sharded logits is scoped to the
loss, falls back to gathered outputs with a warning, and runs without autograd in evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.codegen.loss_parallel import ModelLoss


@pytest.fixture
def mesh(one_process_group):
    return DeviceMesh("cpu", [0])


def _model(weight: torch.Tensor, mesh=None):
    """A log_softmax inside the model, before the loss: loss_parallel's rules must not touch it."""
    if mesh is None:
        return torch.log_softmax(weight * 3.0, dim=-1)
    hidden = DTensor.from_local(weight * 3.0, mesh, [Replicate()], run_check=False)
    return torch.log_softmax(hidden, dim=-1).redistribute(mesh, [Shard(1)])


def _inputs() -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """(a weight needing a gradient, targets, one device's loss and weight gradient)."""
    torch.manual_seed(0)
    weight, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
    reference = weight.clone().requires_grad_(True)
    loss = F.cross_entropy(_model(reference), targets)
    loss.backward()
    return weight.requires_grad_(True), targets, loss.item(), reference.grad


def _trained(model_loss: ModelLoss, weight: torch.Tensor, targets: torch.Tensor, mesh) -> torch.Tensor:
    loss = model_loss((_model(weight, mesh),), targets)
    assert not isinstance(loss, DTensor)
    loss.backward()
    return loss


def test_the_loss_runs_on_sharded_logits_and_the_models_own_log_softmax_keeps_its_gradient(mesh) -> None:
    weight, targets, expected_loss, expected_grad = _inputs()
    model_loss = ModelLoss(F.cross_entropy, lambda values: values[0], sharded=True)
    loss = _trained(model_loss, weight, targets, mesh)
    assert model_loss.fallback_reason is None
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(weight.grad, expected_grad)


def test_a_loss_dtensor_cannot_run_falls_back_to_gathered_outputs_with_a_warning(mesh) -> None:
    weight, targets, expected_loss, expected_grad = _inputs()

    def plain_tensors_only(logits, targets):
        if isinstance(logits, DTensor):
            raise NotImplementedError("no rule for this op")
        return F.cross_entropy(logits, targets)

    model_loss = ModelLoss(plain_tensors_only, lambda values: values[0], sharded=True)
    with pytest.warns(RuntimeWarning, match="gathered for the loss"):
        loss = _trained(model_loss, weight, targets, mesh)
    assert not model_loss.sharded and "no rule for this op" in model_loss.fallback_reason
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(weight.grad, expected_grad)


def test_evaluation_runs_the_sharded_loss_without_autograd(mesh) -> None:
    weight, targets, expected_loss, _ = _inputs()
    with torch.no_grad():
        loss = ModelLoss(F.cross_entropy, lambda values: values[0], sharded=True)((_model(weight, mesh),), targets)
    assert not isinstance(loss, DTensor) and not loss.requires_grad
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)

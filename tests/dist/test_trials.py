"""Trials on 2 gloo processes leave the user's parameters, gradients, optimizer state and RNG
bit-equal, and `parallelize(..., trials=2)` builds the measured winner with its record."""

from __future__ import annotations

import pytest

from harness import run_workers, tiny_model_cluster

pytestmark = pytest.mark.dist

GPT_SPEC = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.1"
GLOBAL_BATCH = 8


def _snapshot(model, optimizer):
    import copy

    import torch

    return ({name: param.detach().clone() for name, param in model.named_parameters()},
            {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None},
            copy.deepcopy(optimizer.state_dict()), torch.get_rng_state())


def _equal(left, right) -> bool:
    import torch

    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_equal(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(_equal(a, b) for a, b in zip(left, right))
    return left == right


def trials_worker() -> dict:
    import torch

    import autopar
    from autopar.models import build_model
    from autopar.tune.trials import TrialOptions

    bundle = build_model(GPT_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    model, inputs, targets = bundle.model, tuple(bundle.example_inputs), bundle.example_targets
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bundle.loss_fn(model(*inputs), targets).backward()  # the user has trained a step: state to keep
    optimizer.step()
    before = _snapshot(model, optimizer)
    messages: list[str] = []
    pm = autopar.parallelize(model, tiny_model_cluster(2), inputs, loss_fn=bundle.loss_fn, example_targets=targets,
                             precision="fp32", trials=2, trial_options=TrialOptions(warmup_steps=1, steps=1),
                             progress=messages.append)
    after = _snapshot(model, optimizer)
    same = {part: _equal(b, a) for part, b, a in zip(("parameters", "gradients", "optimizer", "rng"), before, after)}
    trial_optimizer = torch.optim.SGD(pm.parameters(), lr=1e-3)
    for _ in range(4):
        pm.train_step(inputs, targets)
        trial_optimizer.step()
        trial_optimizer.zero_grad()
    report = pm.timing_report(skip=1)
    return dict(same=same, trials=list(pm.plan.trials), messages=messages, report=str(report),
                measured=report.measured_step_s)


def test_trials_leave_the_users_state_bit_equal_and_record_the_candidates():
    for rank, result in enumerate(run_workers(trials_worker, world_size=2, timeout_s=300)):
        assert all(result["same"].values()), (rank, result["same"])
        trials = result["trials"]
        assert len(trials) == 2 and sum(row["chosen"] for row in trials) == 1
        measured = [row["measured_s"] for row in trials if row["measured_s"] and not row["stopped_early"]]
        chosen = next(row for row in trials if row["chosen"])
        assert chosen["measured_s"] == min(measured)
        assert result["measured"] and result["measured"] > 0
        assert "predicted" in result["report"] and "timing over 2 steps" in result["report"]
        if rank == 0:
            assert any("trial 1/2" in message for message in result["messages"])


def keyword_trials_worker() -> dict:
    import torch
    from torch import nn

    import autopar
    from autopar.tune.trials import TrialOptions

    class KeywordModel(nn.Module):
        """Called as users call Hugging Face models: every input by keyword."""

        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 4)

        def forward(self, *, features: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(features))) * scale

    torch.manual_seed(0)
    model = KeywordModel()
    inputs = dict(features=torch.randn(GLOBAL_BATCH, 16), scale=torch.ones(GLOBAL_BATCH, 1))
    targets = torch.randn(GLOBAL_BATCH, 4)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    pm = autopar.parallelize(model, tiny_model_cluster(2), inputs, loss_fn=nn.functional.mse_loss,
                             example_targets=targets, precision="fp32", trials=2,
                             trial_options=TrialOptions(warmup_steps=1, steps=1), progress=lambda message: None)
    loss = pm.train_step(inputs, targets)
    same = all(torch.equal(before[name], param) for name, param in model.named_parameters())
    return dict(same=same, trials=list(pm.plan.trials), loss=float(loss))


def test_trials_take_keyword_inputs():
    for result in run_workers(keyword_trials_worker, world_size=2, timeout_s=300):
        assert result["same"]
        assert len(result["trials"]) >= 1 and sum(row["chosen"] for row in result["trials"]) == 1
        assert all(row["measured_s"] for row in result["trials"]), result["trials"]
        assert result["loss"] > 0

"""What the enumeration of configurations says when none is left (solver/enumerate.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import InfeasiblePlanError


class FixedBatch(nn.Module):
    """Four layers behind a reshape to a literal batch: torch.export cannot keep the batch dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(4, 8)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_a_fixed_batch_capture_is_the_reason_a_pipeline_has_too_few_microbatches():
    with pytest.raises(InfeasiblePlanError) as raised:
        autopar.plan(FixedBatch(), torch.randn(4, 8), "cpu:procs=2", global_batch=4, constraints={"pp": 2, "dp": 1})
    message = str(raised.value)
    assert "captured with a fixed batch of 4" in message
    assert "gets 1 microbatch(es)" in message and "fewer than the 2 stages" in message
    assert "every candidate was ruled out" not in message

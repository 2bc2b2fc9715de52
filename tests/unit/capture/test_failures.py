"""Why a capture failed, said where the user can act (capture/failures.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.capture.failures import failing_location
from autopar.errors import CaptureError

_GENERATED = {}
exec(compile("def helper(x):\n    raise ValueError('boom')\n", "<string>", "exec"), _GENERATED)


class CallsGeneratedCode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GENERATED["helper"](x)  # the model's line


def test_the_location_is_the_models_line_not_generated_code():
    model = CallsGeneratedCode()
    with pytest.raises(ValueError) as raised:
        model(torch.zeros(1))
    location = failing_location(raised.value, model)
    assert "<string>" not in location
    assert "test_failures.py" in location and "the model's line" in location
    assert "module '<root>' (CallsGeneratedCode)" in location


class LoopedExperts(nn.Module):
    """Each expert runs on the tokens routed to it, found with nonzero: data-dependent shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)  # the data-dependent line
            out = out.index_add(0, rows, expert(x[rows]))
        return out.sum()


def test_a_data_dependent_expert_loop_names_its_line_and_the_grouped_matmul_way():
    with pytest.raises(CaptureError) as raised:
        capture(LoopedExperts(), (torch.randn(4, 8),))
    message = str(raised.value)
    assert "test_failures.py" in message
    assert "grouped matmul" in message and "torch._grouped_mm" in message


class ClampsItsData(nn.Module):
    """Clamps a weight's .data in training, as Gemma 3n's AltUp does: export cannot trace the write."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.coefs = nn.Linear(4, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.coefs.weight.data.clamp_(-1.0, 1.0)
        return self.coefs(torch.tanh(self.router(x))).sum()


def test_a_write_to_data_in_forward_says_what_export_missed():
    from autopar.capture.export import capture_program

    with pytest.raises(CaptureError) as raised:  # as codegen captures: export only
        capture_program(ClampsItsData(), (torch.randn(4, 8),), allow_fallback=False)
    message = str(raised.value)
    assert "`.data`" in message and "another model" in message

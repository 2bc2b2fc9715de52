"""A plain MLP regressor: input projection, residual Linear+GELU blocks, output head.

The smallest model with repeated blocks; planner tests use it where a transformer is overkill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.spec import check_field_types, require_positive

NAMED_SIZES: dict[str, dict[str, object]] = {}


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Shape of the MLP; the defaults are a tiny model that trains on a CPU in milliseconds."""

    family: ClassVar[str] = "mlp"

    in_features: int = 32  # input width
    hidden: int = 64  # width of every block
    layers: int = 2  # number of residual blocks
    out_features: int = 8  # output width

    def __post_init__(self) -> None:
        check_field_types(self)
        require_positive(self, "in_features", "hidden", "layers", "out_features")


class MLPBlock(nn.Module):
    """x + gelu(fc(x)); the residual keeps deep stacks trainable."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class MLP(nn.Module):
    """(batch, in_features) -> (batch, out_features)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.input_proj = nn.Linear(config.in_features, config.hidden)
        self.layers = nn.ModuleList(MLPBlock(config.hidden) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.out_features)

    def init_weights(self) -> None:
        """(Re)initializes every parameter in place with PyTorch's default Linear init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def example_inputs(
    config: MLPConfig, batch_size: int, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Random features (batch, in_features)."""
    return (torch.randn(batch_size, config.in_features, device=device),)


def example_targets(config: MLPConfig, batch_size: int, device: torch.device | str) -> torch.Tensor:
    """Random regression targets (batch, out_features)."""
    return torch.randn(batch_size, config.out_features, device=device)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(output, targets)

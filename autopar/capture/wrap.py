"""What the capture wraps around the user's model: the loss as part of the traced graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

LOSS_WRAPPER_PREFIX = "model."
LOSS_MODULE_PATH = "<loss>"
"""Module path of the ops that `loss_fn` runs (outside the model's modules)."""


class WithLoss(nn.Module):
    """Wraps model and loss so that the captured graph ends in the scalar loss.

    The model's keyword inputs arrive as positional ones before the targets, named by
    `keyword_names`: torch.export cannot take dynamic shapes for a `**kwargs` argument.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, keyword_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keyword_names = tuple(keyword_names)

    def forward(self, *inputs_and_targets):
        *inputs, targets = inputs_and_targets
        split = len(inputs) - len(self.keyword_names)
        keywords = dict(zip(self.keyword_names, inputs[split:]))
        return self.loss_fn(self.model(*inputs[:split], **keywords), targets)

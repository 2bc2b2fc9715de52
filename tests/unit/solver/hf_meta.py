"""A tiny Hugging Face causal LM, built on meta and captured for planning with a token loss (the
solver tests of Hugging Face's grouped-matmul experts)."""

from __future__ import annotations

import torch

import autopar
from autopar.models import on_meta


def token_loss(out, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, -2).float(), targets.flatten())


def capture_causal_lm(model_class, config, *, batch_size: int = 2, seq: int = 32):
    """`model_class(config)` on meta, captured with token inputs of [batch_size, seq] as targets."""
    with on_meta():
        model = model_class(config)
    tokens = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    return autopar.capture_for_planning(model, dict(input_ids=tokens), example_targets=tokens, loss_fn=token_loss)

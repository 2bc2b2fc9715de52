"""Vision Transformer (Dosovitskiy et al. 2021): patches -> pre-LayerNorm blocks -> class token head.

Attention is GPT's `SelfAttention` without the causal mask: separate q/k/v projections (so tensor
parallelism shards them by head like GPT's) and, by default, explicit matmul/softmax ops; set
attention="sdpa" for the fused kernel. vit-b16 counts 86,567,656 parameters, as timm's
vit_base_patch16_224.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import INIT_STD, AttentionKind, FeedForward, PreNormBlock, SelfAttention, init_normal
from autopar.models.spec import check_field_types, require_divisible, require_positive, require_probability

__all__ = ["ViTConfig", "ViT", "example_inputs", "example_targets", "loss_fn"]


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """Shape of a ViT classifier; the defaults are a tiny model that trains on a CPU in seconds."""

    family: ClassVar[str] = "vit"

    image_size: int = 32  # input height and width in pixels
    patch: int = 8  # patch height and width; must divide image_size
    channels: int = 3  # input channels
    layers: int = 2  # number of transformer blocks
    hidden: int = 64  # model width
    heads: int = 4  # attention heads; must divide hidden
    ffn_hidden: int | None = None  # MLP width; None means 4 * hidden (resolved in __post_init__)
    num_classes: int = 10  # classifier outputs
    dropout: float = 0.1  # embedding, attention and residual dropout probability
    attention: AttentionKind = "eager"  # "eager": explicit matmul/softmax ops; "sdpa": fused kernel

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)  # frozen: resolve the default once
        require_positive(
            self, "image_size", "patch", "channels", "layers", "hidden", "heads", "ffn_hidden", "num_classes"
        )
        require_divisible(self, "image_size", "patch")
        require_divisible(self, "hidden", "heads")
        require_probability(self, "dropout")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


_IMAGENET = {"image_size": 224, "patch": 16, "channels": 3, "num_classes": 1000}
NAMED_SIZES: dict[str, dict[str, object]] = {
    "vit-b16": {"layers": 12, "hidden": 768, "heads": 12, "ffn_hidden": 3072, **_IMAGENET},
    "vit-l16": {"layers": 24, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, **_IMAGENET},
}


class PatchEmbedding(nn.Module):
    """Images (batch, channels, H, W) -> [class token, patch tokens] + positions (batch, 1 + patches, hidden)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(config.channels, config.hidden, kernel_size=config.patch, stride=config.patch)
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.hidden))
        self.positions = nn.Parameter(torch.empty(1, 1 + config.num_patches, config.hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes the class token and positions (the conv has its own init)."""
        nn.init.normal_(self.cls_token, std=INIT_STD)
        nn.init.normal_(self.positions, std=INIT_STD)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.proj(images).flatten(2).transpose(1, 2)  # (batch, patches, hidden)
        cls_tokens = self.cls_token.expand(patches.shape[0], -1, -1)
        return torch.cat((cls_tokens, patches), dim=1) + self.positions


class ViT(nn.Module):
    """Image classifier: images (batch, channels, image_size, image_size) -> logits (batch, num_classes)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = PatchEmbedding(config)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(_block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initializes every parameter in place, e.g. after `to_empty()` of a meta model."""
        init_normal(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed_dropout(self.embeddings(images))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def _block(config: ViTConfig) -> PreNormBlock:
    attn = SelfAttention(
        hidden=config.hidden,
        heads=config.heads,
        dropout=config.dropout,
        causal=False,
        attention=config.attention,
    )
    mlp = FeedForward(hidden=config.hidden, ffn_hidden=config.ffn_hidden, dropout=config.dropout)
    return PreNormBlock(hidden=config.hidden, attn=attn, mlp=mlp)


def example_inputs(
    config: ViTConfig, batch_size: int, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Random images (batch, channels, image_size, image_size)."""
    shape = (batch_size, config.channels, config.image_size, config.image_size)
    return (torch.randn(shape, device=device),)


def example_targets(config: ViTConfig, batch_size: int, device: torch.device | str) -> torch.Tensor:
    """Random class labels (batch,)."""
    return torch.randint(0, config.num_classes, (batch_size,), device=device)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits (batch, classes), labels (batch,)."""
    return F.cross_entropy(output, targets)

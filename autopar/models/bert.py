"""BERT encoder with its masked-language-model head (Devlin et al. 2019).

Token + position + token-type embeddings and a LayerNorm; post-LayerNorm blocks (no attention
mask: every input is a full-length sequence); the MLM head is dense + GELU + LayerNorm and a
decoder tied to the word embeddings with its own bias. bert-base counts 109,514,298 parameters,
as Hugging Face's BertForMaskedLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import (
    FeedForward,
    SelfAttention,
    check_seq_len,
    example_inputs,
    example_targets,
    init_normal,
    loss_fn,
)
from autopar.models.spec import check_field_types, require_divisible, require_positive, require_probability

__all__ = ["BertConfig", "Bert", "example_inputs", "example_targets", "loss_fn"]

LAYER_NORM_EPS = 1e-12  # BERT's value


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Shape of a BERT model; the defaults are a tiny model that trains on a CPU in seconds."""

    family: ClassVar[str] = "bert"

    layers: int = 2  # number of encoder blocks
    hidden: int = 64  # model width
    heads: int = 4  # attention heads; must divide hidden
    seq: int = 32  # maximum sequence length (rows of the position embedding)
    vocab: int = 128  # vocabulary size (rows of the tied word embedding)
    ffn_hidden: int | None = None  # MLP width; None means 4 * hidden (resolved in __post_init__)
    token_types: int = 2  # segment ids (rows of the token-type embedding)
    dropout: float = 0.1  # embedding, attention and residual dropout probability

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)  # frozen: resolve the default once
        require_positive(self, "layers", "hidden", "heads", "seq", "vocab", "ffn_hidden", "token_types")
        require_divisible(self, "hidden", "heads")
        require_probability(self, "dropout")


NAMED_SIZES: dict[str, dict[str, object]] = {
    "bert-base": {"layers": 12, "hidden": 768, "heads": 12, "seq": 512, "vocab": 30522},
    "bert-large": {"layers": 24, "hidden": 1024, "heads": 16, "seq": 512, "vocab": 30522},
}


class PostNormBlock(nn.Module):
    """attn_norm(x + attn(x)), then mlp_norm(x + mlp(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(
            hidden=config.hidden, heads=config.heads, dropout=config.dropout, causal=False
        )
        self.attn_norm = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS)
        self.mlp = FeedForward(hidden=config.hidden, ffn_hidden=config.ffn_hidden, dropout=config.dropout)
        self.mlp_norm = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.mlp(x))


class MLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the word embedding (passed in: it is tied) plus a bias."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.norm = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS)
        self.decoder_bias = nn.Parameter(torch.empty(config.vocab))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeroes the decoder bias (dense and norm are submodules with their own init)."""
        nn.init.zeros_(self.decoder_bias)

    def forward(self, x: torch.Tensor, word_embedding: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(F.gelu(self.dense(x))), word_embedding, self.decoder_bias)


class Bert(nn.Module):
    """Encoder + MLM head: token ids (batch, seq) [, token types] -> logits (batch, seq, vocab)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.position_embeddings = nn.Embedding(config.seq, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.token_types, config.hidden)
        self.embed_norm = nn.LayerNorm(config.hidden, eps=LAYER_NORM_EPS)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(PostNormBlock(config) for _ in range(config.layers))
        self.mlm_head = MLMHead(config)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initializes every parameter in place, e.g. after `to_empty()` of a meta model."""
        init_normal(self)

    def forward(self, token_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(check_seq_len(token_ids, self.config.seq), device=token_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(token_ids)
        x = self.word_embeddings(token_ids) + self.position_embeddings(positions)
        x = self.embed_dropout(self.embed_norm(x + self.token_type_embeddings(token_type_ids)))
        for block in self.layers:
            x = block(x)
        return self.mlm_head(x, self.word_embeddings.weight)

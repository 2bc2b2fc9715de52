"""GPT as in Megatron-LM: learned positions, pre-LayerNorm blocks, logits tied to the token embedding.

With ffn_hidden = 4 * hidden, the parameter count without the final LayerNorm is Megatron's
P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) (Narayanan et al., SC21): per block 4h^2 + 4h for
q/k/v/o, 8h^2 + 5h for the MLP and 4h for two LayerNorms; plus (V + s) h of embeddings.

`SelfAttention`, `FeedForward` and `PreNormBlock` are shared with the bert, vit and moe families.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.spec import check_field_types, require_divisible, require_positive, require_probability

AttentionKind = Literal["eager", "sdpa"]

INIT_STD = 0.02  # GPT-2 / Megatron weight init


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model; the defaults are a tiny model that trains on a CPU in seconds.

    ffn_hidden=None is resolved to 4 * hidden at construction, so `dataclasses.replace(config,
    hidden=...)` keeps the old width unless it also passes ffn_hidden=None.
    """

    family: ClassVar[str] = "gpt"

    layers: int = 2  # number of transformer blocks
    hidden: int = 64  # model width h
    heads: int = 4  # attention heads; must divide hidden
    seq: int = 32  # maximum sequence length (rows of the position embedding)
    vocab: int = 128  # vocabulary size (rows of the tied token embedding)
    ffn_hidden: int | None = None  # MLP width; None means 4 * hidden (resolved in __post_init__)
    dropout: float = 0.1  # embedding, attention and residual dropout probability
    attention: AttentionKind = "eager"  # "eager": explicit matmul/softmax ops; "sdpa": fused kernel

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)  # frozen: resolve the default once
        require_positive(self, "layers", "hidden", "heads", "seq", "vocab", "ffn_hidden")
        require_divisible(self, "hidden", "heads")
        require_probability(self, "dropout")


# Published shapes (GPT-3 paper, Table 2.1) with Megatron's seq 2048 and padded GPT-2 vocab 51200.
_GPT3 = {"seq": 2048, "vocab": 51200}
NAMED_SIZES: dict[str, dict[str, object]] = {
    "gpt3-125m": {"layers": 12, "hidden": 768, "heads": 12, **_GPT3},
    "gpt3-350m": {"layers": 24, "hidden": 1024, "heads": 16, **_GPT3},
    # The paper lists 24 heads, which do not divide 2048; Megatron uses 16 (head_dim 128).
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, **_GPT3},
    "gpt3-2.7b": {"layers": 32, "hidden": 2560, "heads": 32, **_GPT3},
    "gpt3-6.7b": {"layers": 32, "hidden": 4096, "heads": 32, **_GPT3},
    # The paper prints d_model 5140 for 13B; its 40 heads x d_head 128 give 5120, used here.
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, **_GPT3},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, **_GPT3},
}


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (tensor parallel shards them by head)."""

    def __init__(
        self, *, hidden: int, heads: int, dropout: float, causal: bool, attention: AttentionKind = "eager"
    ) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.causal = causal
        self.attention = attention
        self.dropout_p = dropout
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = (self._split_heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.attention == "sdpa":
            dropout_p = self.dropout_p if self.training else 0.0
            context = F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout_p, is_causal=self.causal
            )
        else:
            context = self._eager_attention(query, key, value)
        return self.resid_dropout(self.o_proj(context.transpose(1, 2).flatten(-2)))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, heads, seq, head_dim); never reads the batch size."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _eager_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v with as few passes over the s x s scores as eager
        PyTorch allows, as Megatron-LM's attention: the scale is applied to q (s x d elements, not
        s x s) and the mask is one `where` kernel (`masked_fill` would copy the scores first)."""
        scores = (query * (1.0 / math.sqrt(self.head_dim))) @ key.transpose(-2, -1)
        if self.causal:
            seq_len = query.shape[-2]
            allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()
            scores = torch.where(allowed, scores, float("-inf"))
        return self.attn_dropout(scores.softmax(dim=-1)) @ value


class FeedForward(nn.Module):
    """Two-layer GELU MLP followed by dropout."""

    def __init__(self, *, hidden: int, ffn_hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, ffn_hidden)
        self.fc_out = nn.Linear(ffn_hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class PreNormBlock(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)); the mlp may be any (batch, seq, hidden) module."""

    def __init__(self, *, hidden: int, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def make_feed_forward(config: GPTConfig) -> nn.Module:
    return FeedForward(hidden=config.hidden, ffn_hidden=config.ffn_hidden, dropout=config.dropout)


class GPT(nn.Module):
    """Decoder-only language model: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(
        self, config: GPTConfig, make_mlp: Callable[[GPTConfig], nn.Module] = make_feed_forward
    ) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq, config.hidden)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(hidden=config.hidden, attn=_causal_attention(config), mlp=make_mlp(config))
            for _ in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initializes every parameter in place, e.g. after `to_empty()` of a meta model."""
        init_normal(self)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        seq_len = check_seq_len(token_ids, self.config.seq)
        positions = torch.arange(seq_len, device=token_ids.device)
        x = self.embed_dropout(self.wte(token_ids) + self.wpe(positions))
        for block in self.layers:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output embedding: no head parameter


def _causal_attention(config: GPTConfig) -> SelfAttention:
    return SelfAttention(
        hidden=config.hidden,
        heads=config.heads,
        dropout=config.dropout,
        causal=True,
        attention=config.attention,
    )


def init_normal(model: nn.Module, std: float = INIT_STD) -> None:
    """Normal(0, std) Linear/Embedding weights and zero biases; other modules use `reset_parameters`.

    Runs on meta tensors without allocating, so a 175B model initializes instantly there.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif module is not model and hasattr(module, "reset_parameters"):
                module.reset_parameters()


def check_seq_len(token_ids: torch.Tensor, max_seq: int) -> int:
    """The sequence length (dim 1); only the batch dim is dynamic, so this is a Python int."""
    seq_len = token_ids.shape[1]
    if seq_len > max_seq:
        raise ValueError(f"input has {seq_len} positions but the model was built for seq={max_seq}")
    return seq_len


def parameter_count_formula(config: GPTConfig) -> int:
    """Megatron's P = 12 l h^2 + 13 l h + (V + s) h: every parameter but the final LayerNorm."""
    layers, hidden = config.layers, config.hidden
    return 12 * layers * hidden**2 + 13 * layers * hidden + (config.vocab + config.seq) * hidden


def example_inputs(
    config: GPTConfig, batch_size: int, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Random token ids (batch, seq)."""
    return (torch.randint(0, config.vocab, (batch_size, config.seq), device=device),)


def example_targets(config: GPTConfig, batch_size: int, device: torch.device | str) -> torch.Tensor:
    """Random target token ids (batch, seq)."""
    return torch.randint(0, config.vocab, (batch_size, config.seq), device=device)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions; logits (..., classes), integer targets (...).

    Computed in fp32 from 16-bit logits, as Megatron-LM and torchtitan do: the planner then
    prices (and the memory breakdown counts) the fp32 copy of the logits and its softmax."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())

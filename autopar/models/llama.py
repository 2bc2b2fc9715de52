"""LLaMA: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, untied output head.

Rotary cos/sin tables are non-persistent buffers of shape (seq, head_dim) on the model (not on
every block) and are passed to each block, as torchtitan does; on meta they stay meta, and
`init_weights()` recomputes them after `to_empty()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelSpecError
from autopar.models.gpt import check_seq_len, example_inputs, example_targets, init_normal, loss_fn
from autopar.models.spec import check_field_types, require_divisible, require_positive

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "example_inputs", "example_targets", "loss_fn"]


NORMS = ("fused", "float32")
"""How RMSNorm runs: "fused" is `F.rms_norm` (torchtitan today); "float32" upcasts the input and
normalizes in separate float32 ops (torchtitan's `norm_type = "rmsnorm"` of 2024, Hugging Face's
LlamaRMSNorm), which costs several memory passes and keeps float32 copies for the backward."""


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA model; the defaults are a tiny model that trains on a CPU in seconds."""

    family: ClassVar[str] = "llama"

    layers: int = 2  # number of transformer blocks
    hidden: int = 64  # model width
    heads: int = 4  # query heads; must divide hidden
    kv_heads: int = 2  # key/value heads (grouped-query attention); must divide heads
    ffn_hidden: int = 176  # SwiGLU width (LLaMA uses about 8/3 * hidden, rounded up)
    seq: int = 32  # maximum sequence length (rows of the rotary tables)
    vocab: int = 128  # vocabulary size
    rope_theta: float = 10000.0  # rotary base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    norm: str = "fused"  # "fused": F.rms_norm (one CUDA kernel); "float32": upcast in separate ops (torchtitan 2024)

    def __post_init__(self) -> None:
        check_field_types(self)
        require_positive(self, "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq", "vocab")
        require_positive(self, "rope_theta", "norm_eps")
        require_divisible(self, "hidden", "heads")
        require_divisible(self, "heads", "kv_heads")
        if self.norm not in NORMS:
            raise ModelSpecError(f"llama: norm='{self.norm}' is not one of {', '.join(NORMS)}")
        if self.head_dim % 2:
            raise ModelSpecError(
                f"llama: head dim hidden/heads = {self.head_dim} must be even for rotary embeddings; "
                "change hidden or heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Meta's published Llama 3 shapes (model cards / params.json).
_LLAMA3 = {"kv_heads": 8, "vocab": 128256, "seq": 8192, "rope_theta": 500000.0, "norm_eps": 1e-5}
NAMED_SIZES: dict[str, dict[str, object]] = {
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 14336, **_LLAMA3},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "ffn_hidden": 28672, **_LLAMA3},
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight as one fused op (`F.rms_norm`, `aten.rms_norm` in the export), as
    torchtitan runs it: on CUDA one kernel that accumulates in float32 and saves only its input
    and the per-row 1 / rms for the backward (no float32 copy of the activations). With
    `upcast`, the float32 composite instead (NORMS)."""

    def __init__(self, hidden: int, eps: float, upcast: bool = False) -> None:
        super().__init__()
        self.eps, self.upcast = eps, upcast
        self.weight = nn.Parameter(torch.empty(hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            x_float = x.float()
            normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            return normed.type_as(x) * self.weight
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (seq, head_dim) in the rotate-half layout."""

    def __init__(self, head_dim: int, seq: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.seq, self.theta = head_dim, seq, theta
        self.register_buffer("cos", torch.empty(seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fills the buffers (named for the `reset_parameters` convention so inits find it)."""
        device = self.cos.device
        even_dims = torch.arange(0, self.head_dim, 2, device=device).float()
        inv_freq = 1.0 / self.theta ** (even_dims / self.head_dim)
        angles = torch.outer(torch.arange(self.seq, device=device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates (batch, heads, seq, head_dim) by position; cos/sin are (seq, head_dim)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated_half * sin).type_as(x)


class GroupedQueryAttention(nn.Module):
    """Causal attention with kv_heads shared by groups of query heads; no biases.

    K and V go to sdpa with their kv_heads (`enable_gqa=True`), not repeated to every query
    head: the fused kernels read each kv head for its group of query heads, so only kv_heads
    of K and V are kept for the backward (and gathered under context parallelism)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        query = apply_rotary(self._split_heads(self.q_proj(x), self.num_heads), cos, sin)
        key = apply_rotary(self._split_heads(self.k_proj(x), self.num_kv_heads), cos, sin)
        value = self._split_heads(self.v_proj(x), self.num_kv_heads)
        return self.o_proj(self._attend(query, key, value).transpose(1, 2).flatten(-2))

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, head_dim) causal attention; a subclass may mask otherwise."""
        return F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _split_heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.unflatten(-1, (num_heads, self.head_dim)).transpose(1, 2)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); no biases."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm attention and SwiGLU, each with a residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        upcast = config.norm == "float32"
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps, upcast)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps, upcast)
        self.mlp = SwiGLU(config.hidden, config.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only language model: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.rotary = RotaryEmbedding(self.rotary_dim(config), config.seq, config.rope_theta)
        self.layers = nn.ModuleList(self.make_layers(config))
        self.norm = RMSNorm(config.hidden, config.norm_eps, getattr(config, "norm", "") == "float32")
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.init_weights()

    @staticmethod
    def rotary_dim(config) -> int:
        """Width the rotary tables cover (a subclass's attention may rotate part of a head)."""
        return config.head_dim

    @staticmethod
    def make_layers(config) -> list[nn.Module]:
        """The decoder blocks, each called as block(x, cos, sin)."""
        return [LlamaBlock(config) for _ in range(config.layers)]

    def init_weights(self) -> None:
        """(Re)initializes every parameter and the rotary buffers in place, e.g. after `to_empty()`."""
        init_normal(self)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(check_seq_len(token_ids, self.config.seq))
        x = self.embed_tokens(token_ids)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

"""`moe`: a decoder with routed SwiGLU experts, as Mixtral, Qwen3-MoE, DeepSeek-V3 and GPT-OSS build it.

Llama-style blocks (RMSNorm, rotary, causal sdpa) with grouped-query attention or DeepSeek's
Multi-head Latent Attention (mla.py); the first `dense_layers` blocks have a dense SwiGLU of width
`ffn_hidden`, the others a mixture of experts (moe_layer.py: router, tokens sorted by expert,
experts as two grouped matmuls, shared experts). `router=gshard` builds the GShard model of
2020 instead (moe_gshard.py: GPT blocks, einsum dispatch with a capacity).

Named sizes are the published Hugging Face config.json shapes. Common to all: `seq` is 4,096, the
pre-training length of DeepSeek-V3 and Qwen3 (their long-context stages and Mixtral's 32k and
GPT-OSS's 128k context only lengthen the rotary tables), no load-balancing loss, no dropout.
Left out per model (none changes a parameter count by more than 0.1%):
  mixtral-*       nothing else (46.7B and 140.6B).
  qwen3-*         the per-head RMSNorm of queries and keys (qk-norm; 2 x head_dim weights a layer).
  deepseek-v3     group-limited routing (8 groups, top 4) and the routed scaling factor 2.5 (no
                  shapes), YaRN, and the multi-token-prediction module (14B more weights, counted
                  apart by DeepSeek: 671B without it).
  gpt-oss-120b    attention sinks and the biases of attention and router (116.8B published, 116.8B
                  here). Its experts' biases (`expert_bias`), clamped GLU (`swiglu_limit` 7.0) and
                  128-token sliding windows on every other layer (`sliding_window`) are built.

GPT-OSS's keys (off by default; every other model is unchanged):
  expert_bias     a bias per expert on the gate/up and down projections, added to each row by its
                  expert (`bias[expert of row]`, as transformers' GptOssExperts adds
                  gate_up_proj_bias[e] and down_proj_bias[e]).
  swiglu_limit    > 0: GPT-OSS's clamped GLU instead of silu(gate) x up: gate clamped to at most the
                  limit, up to [-limit, limit], then (up + 1) x gate x sigmoid(1.702 gate)
                  (transformers' GptOssExperts._apply_gate, swiglu_alpha 1.702).
  sliding_window  > 0: blocks 0, 2, 4, ... attend to the last `sliding_window` positions (the query's
                  own included; GPT-OSS's layer_types alternate sliding_attention and
                  full_attention, window 128), through sdpa with a banded boolean mask; the others
                  stay causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelSpecError
from autopar.models.gpt import example_inputs, example_targets, loss_fn
from autopar.models.llama import GroupedQueryAttention, Llama, RMSNorm, SwiGLU
from autopar.models.mla import LatentAttention
from autopar.models.moe_gshard import GShardMoEGPT
from autopar.models.moe_layer import MoELayer
from autopar.models.spec import check_field_types, require_divisible, require_positive, require_probability

__all__ = ["MoE", "MoEConfig", "build", "example_inputs", "example_targets", "loss_fn"]

RouterKind = Literal["softmax", "sigmoid", "gshard"]
AttentionKind = Literal["gqa", "mla"]
GSHARD_CAPACITY_FACTOR = 1.25  # GShard's and Switch Transformer's slack when capacity_factor is not given


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of a mixture-of-experts decoder; the defaults are a tiny model that trains on a CPU."""

    family: ClassVar[str] = "moe"

    layers: int = 2  # transformer blocks, dense ones included
    hidden: int = 64  # model width
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads of gqa attention; must divide heads
    head_dim: int | None = None  # gqa head width; None: hidden / heads (mla: qk_nope + qk_rope)
    seq: int = 32  # maximum sequence length (rows of the rotary tables)
    vocab: int = 128  # vocabulary size (untied embedding and head)
    ffn_hidden: int = 176  # SwiGLU width of the dense layers
    dense_layers: int = 0  # leading blocks with a dense SwiGLU instead of experts
    num_experts: int = 4  # routed experts per MoE layer
    top_k: int = 2  # experts each token is sent to
    expert_ffn_hidden: int = 64  # SwiGLU width of one expert (routed or shared)
    shared_experts: int = 0  # experts every token goes through (one SwiGLU of shared_experts x expert_ffn_hidden)
    router: RouterKind = "softmax"  # softmax: Mixtral/Qwen3; sigmoid: DeepSeek-V3 aux-loss-free; gshard: GShard GPT
    capacity_factor: float | None = None  # 0: dropless; > 0: slots per expert over an even load; None: 0 (gshard 1.25)
    attention: AttentionKind = "gqa"  # gqa: grouped-query attention; mla: Multi-head Latent Attention
    q_lora_rank: int = 0  # mla: query compression width (0: no compression)
    kv_lora_rank: int = 0  # mla: key/value latent width
    qk_nope_head_dim: int = 0  # mla: query/key head width without rotary
    qk_rope_head_dim: int = 0  # mla: query/key head width with rotary (shared by the heads for keys)
    v_head_dim: int = 0  # mla: value head width
    rope_theta: float = 10000.0  # rotary base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    dropout: float = 0.0  # router=gshard only: the GPT blocks' dropout
    expert_bias: bool = False  # a bias per expert on the experts' gate/up and down projections (GPT-OSS)
    swiglu_limit: float = 0.0  # > 0: GPT-OSS's clamped GLU with this limit (7.0); 0: silu(gate) x up
    sliding_window: int = 0  # > 0: every other block from the first attends to this many last positions

    def __post_init__(self) -> None:
        check_field_types(self)
        require_positive(self, "layers", "hidden", "heads", "kv_heads", "seq", "vocab", "ffn_hidden", "num_experts",
                         "top_k", "expert_ffn_hidden", "rope_theta", "norm_eps")
        _require_non_negative(self, "dense_layers", "shared_experts", "q_lora_rank", "kv_lora_rank",
                              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "swiglu_limit", "sliding_window")
        require_probability(self, "dropout")
        if self.top_k > self.num_experts:
            raise ModelSpecError(f"moe: top_k ({self.top_k}) must be at most num_experts ({self.num_experts}); "
                                 "lower top_k")
        if self.dense_layers >= self.layers:
            raise ModelSpecError(f"moe: dense_layers ({self.dense_layers}) must be less than layers ({self.layers}) "
                                 "so that some layer has experts; lower dense_layers or use the llama family")
        self._resolve_capacity_factor()
        if self.router == "gshard":
            _check_gshard(self)
        elif self.dropout:
            raise ModelSpecError(f"moe: dropout={self.dropout} applies to router=gshard only (the llama-style blocks "
                                 "have none); drop it or set router=gshard")
        if self.attention == "mla":
            _check_mla(self)
        else:
            _check_gqa(self)

    def _resolve_capacity_factor(self) -> None:
        if self.capacity_factor is None:  # frozen: resolve the default once
            default = GSHARD_CAPACITY_FACTOR if self.router == "gshard" else 0.0
            object.__setattr__(self, "capacity_factor", default)
        if self.capacity_factor < 0:
            raise ModelSpecError(f"moe field 'capacity_factor' must be >= 0 (0 = dropless), got {self.capacity_factor}")


def _require_non_negative(config: MoEConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 0:
            raise ModelSpecError(f"moe field '{name}' must be >= 0, got {getattr(config, name)}")


def _check_gshard(config: MoEConfig) -> None:
    others = {"dense_layers": config.dense_layers, "shared_experts": config.shared_experts,
              "attention=mla": config.attention == "mla", "capacity_factor=0": config.capacity_factor == 0,
              "expert_bias": config.expert_bias, "swiglu_limit": config.swiglu_limit,
              "sliding_window": config.sliding_window}
    unsupported = [name for name, value in others.items() if value]
    if unsupported:
        raise ModelSpecError(f"moe: router=gshard builds the 2020 GShard GPT, which has no {', '.join(unsupported)}; "
                             "drop them or use router=softmax or sigmoid")
    require_divisible(config, "hidden", "heads")


def _check_gqa(config: MoEConfig) -> None:
    require_divisible(config, "heads", "kv_heads")
    if config.head_dim is None:
        require_divisible(config, "hidden", "heads")
        object.__setattr__(config, "head_dim", config.hidden // config.heads)
    require_positive(config, "head_dim")
    if config.head_dim % 2:
        raise ModelSpecError(f"moe: head_dim ({config.head_dim}) must be even for rotary embeddings; change "
                             "head_dim, or hidden or heads")


def _check_mla(config: MoEConfig) -> None:
    if config.sliding_window:
        raise ModelSpecError("moe: sliding_window applies to attention=gqa only; drop it or use attention=gqa")
    for name, example in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                          ("v_head_dim", 128)):
        if getattr(config, name) <= 0:
            raise ModelSpecError(f"moe: attention=mla needs {name} > 0 (DeepSeek-V3: {name}={example}); set {name}")
    if config.qk_rope_head_dim % 2:
        raise ModelSpecError(f"moe: qk_rope_head_dim ({config.qk_rope_head_dim}) must be even for rotary "
                             "embeddings")
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.head_dim is None:
        object.__setattr__(config, "head_dim", qk_dim)
    elif config.head_dim != qk_dim:
        raise ModelSpecError(f"moe: with attention=mla the head width is qk_nope_head_dim + qk_rope_head_dim = "
                             f"{qk_dim}, but head_dim={config.head_dim}; drop head_dim")


_PRETRAIN_SEQ = 4096
_MIXTRAL = {"router": "softmax", "kv_heads": 8, "top_k": 2, "num_experts": 8, "rope_theta": 1e6, "seq": _PRETRAIN_SEQ}
_QWEN3 = {"router": "softmax", "kv_heads": 4, "head_dim": 128, "num_experts": 128, "top_k": 8, "vocab": 151936,
          "rope_theta": 1e6, "norm_eps": 1e-6, "seq": _PRETRAIN_SEQ}
NAMED_SIZES: dict[str, dict[str, object]] = {
    "mixtral-8x7b": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "ffn_hidden": 14336,
                     "expert_ffn_hidden": 14336, **_MIXTRAL},
    "mixtral-8x22b": {"layers": 56, "hidden": 6144, "heads": 48, "vocab": 32768, "ffn_hidden": 16384,
                      "expert_ffn_hidden": 16384, **_MIXTRAL},
    "qwen3-30b-a3b": {"layers": 48, "hidden": 2048, "heads": 32, "ffn_hidden": 6144, "expert_ffn_hidden": 768,
                      **_QWEN3},
    "qwen3-235b-a22b": {"layers": 94, "hidden": 4096, "heads": 64, "ffn_hidden": 12288, "expert_ffn_hidden": 1536,
                        **_QWEN3},
    "deepseek-v3": {"layers": 61, "hidden": 7168, "heads": 128, "kv_heads": 128, "vocab": 129280,
                    "ffn_hidden": 18432, "dense_layers": 3, "num_experts": 256, "top_k": 8, "expert_ffn_hidden": 2048,
                    "shared_experts": 1, "router": "sigmoid", "attention": "mla", "q_lora_rank": 1536,
                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "norm_eps": 1e-6, "seq": _PRETRAIN_SEQ},
    "gpt-oss-120b": {"layers": 36, "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "vocab": 201088,
                     "ffn_hidden": 2880, "num_experts": 128, "top_k": 4, "expert_ffn_hidden": 2880,
                     "router": "softmax", "rope_theta": 150000.0, "seq": _PRETRAIN_SEQ, "expert_bias": True,
                     "swiglu_limit": 7.0, "sliding_window": 128},
}


class WindowedAttention(GroupedQueryAttention):
    """`GroupedQueryAttention` where each query sees the last `window` positions, itself included
    (transformers' sliding_window_causal mask).

    Where the window divides the sequence, the queries go in blocks of `window` rows, each
    attending to the keys of its own block and the block before (2 x window keys, masked to the
    band): one sdpa over (batch x blocks) of window-row tiles, so the tiles outside the band are
    never computed, as FlashAttention's and cuDNN's windowed kernels skip them. Elsewhere sdpa over
    the whole sequence with a banded boolean mask."""

    def __init__(self, config: MoEConfig, window: int) -> None:
        super().__init__(config)
        self.window = window

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        seq = query.shape[-2]
        if seq % self.window == 0 and seq > self.window:
            return self._blocked(query, key, value)
        positions = torch.arange(seq, device=query.device)
        mask = in_window(positions.unsqueeze(-1) - positions, self.window)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _blocked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, head_dim) attention in window-row query blocks over 2-block keys."""
        batch, _, seq, _ = query.shape
        blocks, window = seq // self.window, self.window

        def tiles(tensor: torch.Tensor) -> torch.Tensor:  # (batch, h, seq, d) -> (batch x blocks, h, window, d)
            return tensor.unflatten(2, (blocks, window)).transpose(1, 2).flatten(0, 1)

        def with_previous(tensor: torch.Tensor) -> torch.Tensor:  # each block's keys: the block before, then its own
            own = tensor.unflatten(2, (blocks, window))
            before = torch.cat((torch.zeros_like(own[:, :, :1]), own[:, :, :-1]), dim=2)
            return torch.cat((before, own), dim=3).transpose(1, 2).flatten(0, 1)

        starts = torch.arange(blocks, device=query.device) * window
        rows = starts.unsqueeze(-1) + torch.arange(window, device=query.device)  # [blocks, window]
        columns = starts.unsqueeze(-1) - window + torch.arange(2 * window, device=query.device)
        mask = in_window(rows.unsqueeze(-1) - columns.unsqueeze(-2), window) & (columns >= 0).unsqueeze(-2)
        mask = mask.unsqueeze(1).repeat(batch, 1, 1, 1)  # [batch x blocks, 1, window, 2 window]
        context = F.scaled_dot_product_attention(tiles(query), with_previous(key), with_previous(value),
                                                 attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return context.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)


def in_window(behind: torch.Tensor, window: int) -> torch.Tensor:
    """True where a key `behind` positions before the query (query - key position) is among the
    last `window` positions up to the query's own."""
    return (behind >= 0) & (behind < window)


class MoEBlock(nn.Module):
    """Pre-RMSNorm attention and MLP (dense SwiGLU or `MoELayer`), each with a residual."""

    def __init__(self, config: MoEConfig, *, dense: bool, window: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        if config.attention == "mla":
            self.attn = LatentAttention(config)
        else:
            self.attn = WindowedAttention(config, window) if window else GroupedQueryAttention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = SwiGLU(config.hidden, config.ffn_hidden) if dense else MoELayer(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class MoE(Llama):
    """Decoder-only language model: token ids (batch, seq) -> logits (batch, seq, vocab); Llama's
    embedding, rotary tables, final norm and head around `MoEBlock`s (dense ones first)."""

    def __init__(self, config: MoEConfig) -> None:
        if config.router == "gshard":
            raise ModelSpecError("moe: router=gshard is the GShard GPT; build it with moe.build(config)")
        super().__init__(config)

    @staticmethod
    def rotary_dim(config) -> int:
        return config.qk_rope_head_dim if config.attention == "mla" else config.head_dim

    @staticmethod
    def make_layers(config) -> list[nn.Module]:
        return [MoEBlock(config, dense=index < config.dense_layers,
                         window=config.sliding_window if index % 2 == 0 else 0) for index in range(config.layers)]


def build(config: MoEConfig) -> nn.Module:
    """The model of `config`: `MoE`, or for router=gshard moe_gshard.py's `GShardMoEGPT`."""
    return GShardMoEGPT(config) if config.router == "gshard" else MoE(config)

"""Multi-head Latent Attention (DeepSeek-V2, Liu et al. 2024; DeepSeek-V3), causal, no biases.

    query   = q_b(norm(q_a(x)))  or  q_proj(x) when q_lora_rank = 0      heads x (nope + rope)
    latent, k_rope = kv_a(x)                                            kv_lora_rank + rope
    k_nope, value = kv_b(norm(latent))                                  heads x (nope + v)
    key     = [k_nope, rotary(k_rope) shared by every head]
    out     = o_proj(sdpa(query with rotary on its rope part, key, value))

The rotary part of the key is one head broadcast to all (`expand`, no copy). Softmax scale is
1 / sqrt(nope + rope), sdpa's default for that query width. DeepSeek's YaRN scaling of the
rotary frequencies and of the softmax scale at long context is left out (it changes no shape).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.llama import RMSNorm, apply_rotary

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """(batch, seq, hidden) and rotary cos/sin (seq, qk_rope_head_dim) -> (batch, seq, hidden)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        query_width = config.heads * (self.nope_dim + self.rope_dim)
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(config.hidden, config.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, query_width, bias=False)
        else:
            self.q_proj = nn.Linear(config.hidden, query_width, bias=False)
        self.kv_a_proj = nn.Linear(config.hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, config.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, config.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(config.heads * self.v_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        query = self._split_heads(self._query(x), self.nope_dim + self.rope_dim)
        q_nope, q_rope = query.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        kv = self._split_heads(self.kv_b_proj(self.kv_a_norm(latent)), self.nope_dim + self.v_dim)
        k_nope, value = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin)  # (batch, 1, seq, rope): one head for all
        query = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)
        key = torch.cat((k_nope, k_rope.expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1)
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.o_proj(context.transpose(1, 2).flatten(-2))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def _split_heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, head_dim)).transpose(1, 2)

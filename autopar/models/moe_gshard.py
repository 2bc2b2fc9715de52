"""`moe:router=gshard`: GPT with a top-k routed mixture of experts in every block (GShard, Lepikhin et al. 2020).

The 2020 design the `moe` family keeps for comparison (moe.py builds it for router=gshard): GPT
attention and LayerNorm, GELU experts of width `expert_ffn_hidden`, einsum dispatch with a
capacity (`capacity_factor`, 1.25 when not given).

Routing follows GShard's dispatch/combine formulation with one-hot tensors and einsum, so every
shape is static except the batch:

- Tokens are routed within groups, and a group is one sequence (GShard splits tokens into groups
  for the same reason). Each expert takes at most
      capacity = ceil(capacity_factor * seq * top_k / num_experts)
  tokens per sequence. A capacity over all batch * seq tokens would make the dispatch tensor
  quadratic in the batch and, under a dynamic batch, `torch.export` fails on the guards that the
  float ceil of a symbolic size produces.
- Slots are given in order of choice, then position: every token's first choice is placed
  before any second choice. The position in the expert is a cumsum of one-hot masks (no boolean
  indexing, no data-dependent shapes); a token past capacity is dropped for that expert (its
  weight is zero) and only the residual carries it.
- Experts are stacked parameters w_in [experts, hidden, ffn_hidden] and w_out [experts,
  ffn_hidden, hidden] without biases, so expert parallelism shards their leading dim, like the
  leading dim of the expert inputs [experts, groups, capacity, hidden].

No load-balancing loss: it would turn the model output into (logits, aux_loss), which every
pipeline stage would have to carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import GPT, INIT_STD, GPTConfig

__all__ = ["GShardFeedForward", "GShardMoEGPT", "GShardShape"]


@dataclass(frozen=True, kw_only=True)
class GShardShape:
    """The expert layer of one block; moe.py's MoEConfig gives the values."""

    hidden: int
    num_experts: int
    top_k: int
    ffn_hidden: int  # each expert's width
    capacity_factor: float  # slack over a perfectly balanced load; 1.0 = no slack
    dropout: float

    def expert_capacity(self, tokens_per_group: int) -> int:
        """Slots per expert per group (sequence): ceil(capacity_factor * tokens * top_k / experts)."""
        return math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.num_experts)


class GShardFeedForward(nn.Module):
    """Router + stacked GELU experts; (batch, seq, hidden) -> (batch, seq, hidden).

    Einsum letters: g group (= sequence), s token, k choice, e expert, c capacity slot,
    m hidden, f ffn_hidden.
    """

    def __init__(self, config: GShardShape) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(config.num_experts, config.hidden, config.ffn_hidden))
        self.w_out = nn.Parameter(torch.empty(config.num_experts, config.ffn_hidden, config.hidden))
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes the stacked experts (the router is an nn.Linear with its own init)."""
        nn.init.normal_(self.w_in, std=INIT_STD)
        nn.init.normal_(self.w_out, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        combine, dispatch = self.route(x)
        expert_inputs = torch.einsum("gsec,gsm->egcm", dispatch, x)
        expert_hidden = F.gelu(torch.einsum("egcm,emf->egcf", expert_inputs, self.w_in))
        expert_outputs = torch.einsum("egcf,efm->egcm", expert_hidden, self.w_out)
        return self.dropout(torch.einsum("gsec,egcm->gsm", combine, expert_outputs))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine weights and 0/1 dispatch mask, both [groups, seq, experts, capacity]."""
        num_experts, top_k = self.config.num_experts, self.config.top_k
        seq_len = x.shape[1]
        capacity = self.config.expert_capacity(seq_len)
        gates = self.router(x).float().softmax(dim=-1)  # [g, s, e]
        top_gates, top_experts = gates.topk(top_k, dim=-1)  # [g, s, k]
        if top_k > 1:  # GShard renormalizes over the chosen experts; top-1 keeps the gate (Switch)
            top_gates = top_gates / top_gates.sum(dim=-1, keepdim=True)
        expert_masks = _one_hot(top_experts, num_experts)  # [g, s, k, e]
        # Number the slots choice-major: all first choices of the sequence, then all second ones.
        choice_major = expert_masks.transpose(1, 2).flatten(1, 2)  # [g, k*s, e]
        slots = (choice_major.cumsum(dim=1) - 1).unflatten(1, (top_k, seq_len)).transpose(1, 2)
        position_in_expert = (slots * expert_masks).sum(dim=-1)  # [g, s, k]
        slot_masks = _one_hot(position_in_expert, capacity).float()  # [g, s, k, c]; zero past capacity
        expert_masks = expert_masks.float()
        # Summing over the k choices keeps dispatch 0/1: a token's k experts are distinct.
        dispatch = torch.einsum("gske,gskc->gsec", expert_masks, slot_masks)
        combine = torch.einsum("gsk,gske,gskc->gsec", top_gates, expert_masks, slot_masks)
        return combine.to(x.dtype), dispatch.to(x.dtype)


def _one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """int64 one-hot by comparison; indices outside [0, num_classes) give all zeros (no range check)."""
    classes = torch.arange(num_classes, device=indices.device)
    return (indices.unsqueeze(-1) == classes).long()


class GShardMoEGPT(GPT):
    """GPT whose every MLP is a `GShardFeedForward`; token ids (batch, seq) -> logits (batch, seq, vocab).

    `config` is moe.py's MoEConfig with router="gshard" (its attention is GPT's: `heads` only)."""

    def __init__(self, config) -> None:
        shape = GShardShape(hidden=config.hidden, num_experts=config.num_experts, top_k=config.top_k,
                            ffn_hidden=config.expert_ffn_hidden, capacity_factor=config.capacity_factor,
                            dropout=config.dropout)
        gpt_config = GPTConfig(layers=config.layers, hidden=config.hidden, heads=config.heads, seq=config.seq,
                               vocab=config.vocab, ffn_hidden=config.expert_ffn_hidden, dropout=config.dropout)
        super().__init__(gpt_config, make_mlp=lambda _: GShardFeedForward(shape))
        self.moe_config = config

"""The `moe` family's expert layer: router, tokens sorted by expert, grouped SwiGLU experts, shared experts.

    gates, choices = router(x)                       [tokens, top_k] each
    rows           = x of every (choice, token) pair, sorted by expert (stable, choice-major)
    offs           = cumulative rows per expert (int32)
    out            = grouped_mm(silu(gate) * up of grouped_mm(rows, w_gate_up, offs), w_down, offs)
                     (gate and up interleaved in w_gate_up's columns: below)
                     (expert_bias: + b_gate_up[e] and + b_down[e] of each row's expert e; swiglu_limit:
                     GPT-OSS's clamped GLU in place of silu(gate) * up, moe.py)
    y[token]       = sum over its choices of gate x out (un-permuted), + shared SwiGLU(x)

Routers:
  softmax   softmax over the experts, top_k, renormalized over the chosen (Mixtral; Qwen3 with
            norm_topk_prob; GPT-OSS's softmax over the top_k logits is the same).
  sigmoid   DeepSeek-V3's aux-loss-free routing: sigmoid scores; a per-expert bias (a buffer that
            training adjusts outside autograd) is added to choose the experts only; the gates are
            the chosen scores normalized to sum 1.

Every shape is static given the token count (rows = tokens x top_k; no nonzero, boolean indexing
or .item()), so the layer exports on meta. Dropless by default; with capacity_factor > 0 an
expert keeps its first ceil(capacity_factor x rows / experts) rows, in order of choice then
token (every first choice before any second one, as GShard), and the rest get gate 0 (they are
still computed: the shapes stay static). The capacity is over the tokens the layer sees (a
micro-batch on one device).

The expert weights are stacked 3-D parameters read only by the grouped matmuls, so expert
parallelism (solver/experts.py) splits them by expert and exchanges the rows (dropless).

w_gate_up interleaves its gate and up columns (column 2j is gate j, 2j + 1 is up j, as GPT-OSS's
checkpoints do), so a tensor-parallel split of its columns (Megatron-Core's column-parallel fc1,
each rank with its own gate and up slices) keeps every pair on one rank: the SwiGLU then runs on
each rank's columns and the down projection is row-parallel, only token-sized collectives around
the layer. Concatenated halves (`chunk(2)`) would put the gates on some ranks and the ups on
others, and the planner would split the matmul along its input instead and reduce-scatter the
[rows, 2 x expert_ffn_hidden] intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import INIT_STD
from autopar.models.grouped_mm import expert_bias, grouped_mm
from autopar.models.llama import SwiGLU

__all__ = ["GroupedExperts", "MoELayer", "Router"]


class Router(nn.Module):
    """(tokens, hidden) -> gates (tokens, top_k) in float32 and the chosen experts (tokens, top_k)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str) -> None:
        super().__init__()
        self.top_k, self.kind = top_k, kind
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        if kind == "sigmoid":
            self.register_buffer("expert_bias", torch.empty(num_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeros the choice bias (the gate is an nn.Linear with its own init)."""
        if self.kind == "sigmoid":
            with torch.no_grad():
                self.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(tokens).float()
        if self.kind == "sigmoid":
            scores = logits.sigmoid()
            choices = (scores + self.expert_bias.float()).topk(self.top_k, dim=-1).indices
            gates = scores.gather(-1, choices)
        else:
            gates, choices = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return gates / gates.sum(dim=-1, keepdim=True), choices


GLU_ALPHA = 1.702
"""GPT-OSS's swiglu_alpha: gate x sigmoid(1.702 gate) (quick GELU) in its clamped GLU."""


class GroupedExperts(nn.Module):
    """SwiGLU experts as two grouped matmuls: rows sorted by expert (rows, hidden) -> (rows, hidden).

    `bias`: a bias per expert on both projections, added to each row by its expert after the
    grouped matmul, which takes none (`expert_bias`); `swiglu_limit` > 0: GPT-OSS's clamped GLU (moe.py)."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, *, bias: bool = False,
                 swiglu_limit: float = 0.0) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden)) if bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=INIT_STD)
        nn.init.normal_(self.w_down, std=INIT_STD)
        for bias in (self.b_gate_up, self.b_down):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate_up = grouped_mm(rows, self.w_gate_up, offs)
        if self.b_gate_up is not None:
            gate_up = expert_bias(gate_up, self.b_gate_up, offs)
        gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)  # interleaved (module docstring)
        if self.swiglu_limit:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
            hidden = (up + 1) * (gate * torch.sigmoid(GLU_ALPHA * gate))
        else:
            hidden = F.silu(gate) * up
        out = grouped_mm(hidden, self.w_down, offs)
        return expert_bias(out, self.b_down, offs) if self.b_down is not None else out


class MoELayer(nn.Module):
    """Routed experts plus shared experts; (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.capacity_factor = config.capacity_factor
        self.router = Router(config.hidden, config.num_experts, config.top_k, config.router)
        self.experts = GroupedExperts(config.num_experts, config.hidden, config.expert_ffn_hidden,
                                      bias=getattr(config, "expert_bias", False),
                                      swiglu_limit=getattr(config, "swiglu_limit", 0.0))
        self.shared = (SwiGLU(config.hidden, config.shared_experts * config.expert_ffn_hidden)
                       if config.shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)
        num_tokens = tokens.shape[0]
        gates, choices = self.router(tokens)
        expert_of_pair = choices.t().reshape(-1)  # choice-major: every first choice, then every second...
        order = expert_of_pair.argsort(stable=True)  # rows sorted by expert
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add(
            0, expert_of_pair, torch.ones_like(expert_of_pair))
        offs = counts.cumsum(dim=0).to(torch.int32)
        rows = self.experts(tokens.index_select(0, order % num_tokens), offs)
        row_gates = gates.t().reshape(-1)[order]
        if self.capacity_factor:
            row_gates = row_gates * self._kept(expert_of_pair[order], counts)
        # type_as, not .to(dtype): the dtype is read at run time (bf16), not fixed at capture (fp32); of the
        # tokens, not the rows, so that the experts' output has one reader (expert_folding.py's region exit)
        weighted = rows * row_gates.unsqueeze(-1).type_as(tokens)
        routed = weighted[order.argsort()].unflatten(0, (self.top_k, num_tokens)).sum(dim=0)
        if self.shared is not None:
            routed = routed + self.shared(tokens)
        return routed.view_as(x)

    def _kept(self, sorted_experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """1.0 for a row within its expert's capacity, else 0.0 (rows sorted by expert).

        position < ceil(limit) is position < limit for an integer position, so the limit stays a
        tensor (no float ceil of a symbolic size under export)."""
        starts = counts.cumsum(dim=0) - counts
        position = torch.arange(sorted_experts.shape[0], device=counts.device) - starts[sorted_experts]
        limit = counts.sum() * (self.capacity_factor / self.num_experts)
        return (position < limit).float()

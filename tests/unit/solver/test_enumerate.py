"""What the enumeration of configurations says when none is left (solver/enumerate.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import InfeasiblePlanError


class FixedBatch(nn.Module):
    """Four layers behind a reshape to a literal batch: torch.export cannot keep the batch dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(4, 8)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_a_fixed_batch_capture_is_the_reason_a_pipeline_has_too_few_microbatches():
    with pytest.raises(InfeasiblePlanError) as raised:
        autopar.plan(FixedBatch(), torch.randn(4, 8), "cpu:procs=2", global_batch=4, constraints={"pp": 2, "dp": 1})
    message = str(raised.value)
    assert "captured with a fixed batch of 4" in message
    assert "gets 1 microbatch(es)" in message and "fewer than the 2 stages" in message
    assert "every candidate was ruled out" not in message


def test_a_fixed_batch_capture_is_the_reason_data_parallelism_has_no_microbatch():
    """Hugging Face's Llama 4 captures with a fixed batch: dp=2 said only that every candidate was
    ruled out."""
    with pytest.raises(InfeasiblePlanError) as raised:
        autopar.plan(FixedBatch(), torch.randn(4, 8), "cpu:procs=2", global_batch=4, constraints={"pp": 1, "dp": 2})
    message = str(raised.value)
    assert "captured with a fixed batch of 4" in message and "dp=2 leaves each replica 2" in message
    assert "every candidate was ruled out" not in message


TINY_MOE = "moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,num_experts=4,expert_ffn_hidden=32"


def test_a_fixed_ep_is_never_dropped_for_offload():
    """Offload runs without ep: with ep fixed, offload is refused, not a plan with ep = 1."""
    with pytest.raises(InfeasiblePlanError) as raised:
        autopar.plan(TINY_MOE, cluster="cpu:procs=2", global_batch=8,
                     constraints={"ep": 2, "offload": True, "zero_stage": 3, "tp": 1})
    assert "does not run with optimizer offload" in str(raised.value)


def test_an_ep_that_does_not_split_the_experts_says_so():
    with pytest.raises(InfeasiblePlanError) as raised:
        autopar.plan("moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,num_experts=4,top_k=2,"
                     "expert_ffn_hidden=32", cluster="cpu:procs=3", global_batch=6, constraints={"ep": 3, "tp": 1})
    assert "the 4 experts per tp rank of an expert layer do not split into ep=3 groups" in str(raised.value)


def test_a_fixed_pipeline_split_keeps_only_the_pipelines_it_divides():
    """8 blocks + the embedding + the head counted = 10: 2 chunks (pp 2, 5 each) and 10 would do,
    4 and 8 would not; every configuration enumerated is one the split cuts."""
    from autopar.solver.constraints import Constraints
    from report_plans import planner

    constraints = Constraints(pipeline_split="uniform:embedding,head", microbatch_size=1, tp=1, recompute="none")
    candidates = planner().candidates
    chunks = {config.pp * config.chunks_per_device
              for tp, pp, dp, cp in candidates.meshes(constraints)
              for config in candidates.configs(tp, pp, dp, 1, constraints, cp)
              if config.pipeline_split == "uniform:embedding,head"}
    assert chunks == {1, 2}  # pp 4 and 8 (and their interleavings, zbv) are left out: 10 does not divide

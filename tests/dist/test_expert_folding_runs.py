"""MoE parallel folding (etp=1 with tp > 1) against one process.

A tiny built-in dropless MoE (`moe:`: softmax router, grouped-matmul SwiGLU experts) and the zoo's
Hugging Face Mixtral train a few SGD steps on 4 processes under tp2 with the ep group drawn from
the tp x dp ranks: attention tensor-parallel, each MoE layer on each tp rank's own tokens with its
experts unsplit by tp (codegen/expert_folding.py), with ZeRO, recomputation and pipelines. Losses
and the first step's gradients are compared with one process (fp32: round-off tolerance), and the
all-to-alls of the first step with the plan's. The plan is the fixed configuration priced by
`evaluate` (etp=1); test_experts_runs.py's Mixtral tp2 cases get it from the search.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
SEQ = 16
NUM_STEPS = 3
LEARNING_RATE = 0.5
TOLERANCE = 1e-4
MOE_SPEC = (f"moe:layers=2,hidden=32,heads=4,kv_heads=2,seq={SEQ},vocab=64,num_experts=4,top_k=2,"
            "expert_ffn_hidden=16,ffn_hidden=64")
MLA_SPEC = (f"moe:layers=3,hidden=32,heads=4,seq={SEQ},vocab=64,num_experts=4,top_k=2,expert_ffn_hidden=16,"
            "dense_layers=1,ffn_hidden=48,shared_experts=1,router=sigmoid,attention=mla,q_lora_rank=16,"
            "kv_lora_rank=16,qk_nope_head_dim=8,qk_rope_head_dim=4,v_head_dim=8")
"""DeepSeek-V3's layer kinds: latent attention, the sigmoid router (a choice-bias buffer), a shared
expert beside the routed ones and a leading dense layer."""


@dataclass(frozen=True)
class Case:
    model: str
    """"moe" (MOE_SPEC), "mla" (MLA_SPEC) or an architecture of hf_zoo.py ("Mixtral")."""
    world_size: int
    config: dict = field(default_factory=dict)
    timeout_s: float = 120.0


def _workload(name: str):
    """(model, loss_fn, batches of (inputs, targets)); inputs a tuple or a dict of keywords."""
    generator = torch.Generator().manual_seed(1)
    if name in ("moe", "mla"):
        from autopar.models import build_model

        bundle = build_model(MOE_SPEC if name == "moe" else MLA_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
        return bundle.model, bundle.loss_fn, [((torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=generator),),
                                               torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=generator))
                                              for _ in range(NUM_STEPS)]
    import hf_zoo

    arch = hf_zoo.BY_NAME[name]
    torch.manual_seed(0)
    return arch.build(), hf_zoo.loss_for(arch), [hf_zoo.batch(arch, GLOBAL_BATCH, generator) for _ in range(NUM_STEPS)]


def _fixed_plan(model, loss_fn, inputs, targets, config: dict):
    from autopar.api import capture_for_planning, planner_for, split_inputs
    from autopar.plans.planning import evaluate_with, fixed_config

    positional, keywords = split_inputs(inputs)
    graph = capture_for_planning(model, positional, loss_fn=loss_fn, example_targets=targets,
                                 example_kwargs=keywords, precision="fp32")
    planner = planner_for(graph, positional, tiny_model_cluster(4), global_batch=GLOBAL_BATCH, loss_fn=loss_fn,
                          example_targets=targets, example_kwargs=keywords, precision="fp32")
    settings = dict(pp=1, schedule="1f1b", virtual_stages=None, layers_per_virtual_stage=None, recompute="none")
    return evaluate_with(planner, fixed_config(planner, **{**settings, **config}))


def folding_case(case: Case) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.codegen.runtime import run_on_rank0

    model, loss_fn, batches = _workload(case.model)
    reference = train_one_process(model, loss_fn, batches, LEARNING_RATE)
    (inputs, targets), *_ = batches
    plan = run_on_rank0(lambda: _fixed_plan(model, loss_fn, inputs, targets, case.config))
    module = parallelize_reusing_captures(f"{case.model}-folded", model, tiny_model_cluster(4), inputs,
                                          loss_fn=loss_fn, example_targets=targets, constraints={}, plan=plan)
    counter = CommDebugMode() if module.plan.mesh["pp"] == 1 else None  # its module hooks break pipelining
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    ran = sum(count for op, count in counter.get_comm_counts().items() if "alltoall" in str(op)) if counter else 0
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), etp=module.plan.etp, ep=module.plan.ep,
                ran_all_to_all=ran, predicted_all_to_all=module.plan.predicted.collectives_per_microbatch.get(
                    "all_to_all", 0), expert_rows=dict(module.stats.expert_rows),
                ep_group=torch.distributed.get_process_group_ranks(module.runtime.ep_group),
                partial_grads=run.partial_grads)


_MORE = pytest.mark.skipif(not os.environ.get("AUTOPAR_EP_ALL"), reason="more 4-process cases: set AUTOPAR_EP_ALL=1")
"""The 3 default cases take about a minute on 2 shared cores; AUTOPAR_EP_ALL=1 runs all 18 (about 2)."""
_FOLDED = dict(tp=2, dp=2, ep=2, etp=1, microbatch_size=4, zero_stage=0)
TABLE = CaseTable([
    # tp2 x dp2, ep2 = the tp pair of each dp rank, ZeRO-0/1/3 (ZeRO-1/3: expert weights FSDP-sharded
    # over the dp x tp / ep = 2 ranks holding the same experts, their average scaled by tp / ep)
    *[case_param(Case(model, 4, {**_FOLDED, "zero_stage": zero}), f"{model.lower()}-tp2-dp2-ep2-etp1-zero{zero}",
                 *([] if (model, zero) in (("moe", 0), ("Mixtral", 3)) else [_MORE]))
      for model in ("moe", "Mixtral") for zero in (0, 1, 3)],
    case_param(Case("mla", 4, _FOLDED), "mla-tp2-dp2-ep2-etp1", _MORE),
    *[case_param(Case(model, 4, _FOLDED), f"{model.lower()}-tp2-dp2-ep2-etp1", _MORE)
      for model in ("Qwen3-MoE", "OLMoE", "GPT-OSS", "DeepSeek-V3")],
    # ep over every rank of the (dp, tp) grid: each rank holds one of the 4 experts, none replicated
    case_param(Case("moe", 4, {**_FOLDED, "ep": 4}), "moe-tp2-dp2-ep4-etp1", _MORE),
    # Recomputation: the folded layers run again in backward (full: their dispatches too)
    case_param(Case("moe", 4, {**_FOLDED, "recompute": "full"}), "moe-tp2-dp2-ep2-etp1-full", _MORE),
    *[case_param(Case("moe", 4, {**_FOLDED, "recompute": mode}), f"moe-tp2-dp2-ep2-etp1-{mode}", _MORE)
      for mode in ("selective", "op", "gathers")],
    # Pipelines: 1F1B, and ZB-V with ZeRO-1 (the backward split into input and weight passes)
    case_param(Case("moe", 4, {**_FOLDED, "dp": 1, "pp": 2}), "moe-tp2-pp2-ep2-etp1", _MORE),
    case_param(Case("moe", 4, {**_FOLDED, "dp": 1, "pp": 2, "microbatch_size": 2, "zero_stage": 1, "schedule": "zbv",
                               "virtual_stages": 2}), "moe-tp2-pp2-ep2-etp1-zbv"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_folded_experts_match_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, folding_case, case_name)
    # Every parameter has its gradient checked on some rank (each pipeline rank holds its stage's).
    assert set().union(*(result["grad_errors"] for result in results)) == set(results[0]["all_parameters"])
    # Every MoE layer ran dropless on each rank's tokens (under pp on the ranks of their stage;
    # GPT-OSS's expert matmuls are not chained: two dispatches a layer; the zoo's DeepSeek-V3 has a
    # leading dense layer)
    dispatches = {"GPT-OSS": 4, "DeepSeek-V3": 1}.get(case.model, 2)
    assert len(set().union(*(result["expert_rows"] for result in results))) == dispatches
    for rank, result in enumerate(results):
        assert (result["etp"], result["ep"]) == (1, case.config["ep"])
        # ep consecutive ranks of the (dp, tp) grid, tp innermost: here the tp pair of each dp rank
        ep = case.config["ep"]
        assert result["ep_group"] == list(range(rank - rank % ep, rank - rank % ep + ep)), result["ep_group"]
        # Each MoE layer ran dropless on this rank's tokens: counts, rows and back (5 per layer)
        assert all(sent > 0 for _, sent in result["expert_rows"].values())
        if case.config.get("recompute", "none") == "none" and case.config.get("pp", 1) == 1:
            assert result["ran_all_to_all"] == result["predicted_all_to_all"] > 0, result
        elif case.config.get("recompute") == "full":  # the forward's 3 of each layer again in backward
            assert result["ran_all_to_all"] == result["predicted_all_to_all"] + 2 * 3, result
        assert not result["partial_grads"], result["partial_grads"]  # the router's reduced over tp in the step
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        if case.config.get("pp", 1) == 1:
            assert set(result["grad_errors"]) == set(result["all_parameters"])
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"

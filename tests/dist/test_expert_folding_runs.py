"""MoE parallel folding (etp=1 with tp > 1) against one process.

A tiny built-in dropless MoE (`moe:`: softmax router, grouped-matmul SwiGLU experts) trains a few
SGD steps on 4 processes under tp2 x dp2 with ep2 drawn from the tp x dp ranks: attention
tensor-parallel, each MoE layer on each tp rank's own tokens with its experts unsplit by tp
(codegen/expert_folding.py). Losses and the first step's gradients are compared with one process
(fp32: round-off tolerance). The plan is the fixed configuration priced by `evaluate` (etp=1).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Case:
    model: str
    """"moe" (MOE_SPEC) or an architecture of hf_zoo.py ("Mixtral")."""
    world_size: int
    config: dict = field(default_factory=dict)
    timeout_s: float = 120.0


def _workload(name: str):
    """(model, loss_fn, batches of (inputs, targets)); inputs a tuple or a dict of keywords."""
    generator = torch.Generator().manual_seed(1)
    if name == "moe":
        from autopar.models import build_model

        bundle = build_model(MOE_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
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
    counter = CommDebugMode()
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    ran = sum(count for op, count in counter.get_comm_counts().items() if "alltoall" in str(op))
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), etp=module.plan.etp, ep=module.plan.ep,
                ran_all_to_all=ran, predicted_all_to_all=module.plan.predicted.collectives_per_microbatch.get(
                    "all_to_all", 0), expert_rows=dict(module.stats.expert_rows),
                ep_group=torch.distributed.get_process_group_ranks(module.runtime.ep_group),
                partial_grads=run.partial_grads)


TABLE = CaseTable([
    *[case_param(Case(model, 4, dict(tp=2, dp=2, ep=2, etp=1, microbatch_size=4, zero_stage=zero)),
                 f"{model.lower()}-tp2-dp2-ep2-etp1-zero{zero}") for model in ("moe", "Mixtral") for zero in (0, 1, 3)],
    # ep over every rank of the (dp, tp) grid: each rank holds one of the 4 experts, none replicated
    case_param(Case("moe", 4, dict(tp=2, dp=2, ep=4, etp=1, microbatch_size=4, zero_stage=0)),
               "moe-tp2-dp2-ep4-etp1"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_folded_experts_match_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, folding_case, case_name)
    for rank, result in enumerate(results):
        assert (result["etp"], result["ep"]) == (1, case.config["ep"])
        # ep consecutive ranks of the (dp, tp) grid, tp innermost: here the tp pair of each dp rank
        ep = case.config["ep"]
        assert result["ep_group"] == list(range(rank - rank % ep, rank - rank % ep + ep)), result["ep_group"]
        # Each MoE layer ran dropless on this rank's tokens: counts, rows and back (5 per layer)
        assert len(result["expert_rows"]) == 2 and all(sent > 0 for _, sent in result["expert_rows"].values())
        assert result["ran_all_to_all"] == 2 * 5 == result["predicted_all_to_all"], result
        assert not result["partial_grads"], result["partial_grads"]  # the router's reduced over tp in the step
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        assert set(result["grad_errors"]) == set(result["all_parameters"])
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"

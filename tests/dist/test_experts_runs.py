"""Expert parallelism against one process: MoE models with their experts split over ep ranks.

Each case trains a tiny MoE for a few SGD steps under a forced expert-parallel plan and compares
the losses and the first step's gradients with one process (fp32: round-off tolerance), and
counts the all-to-alls the first step runs (one microbatch): they must be the plan's predicted
all-to-alls. Models: the built-in MoE (4 experts, top-2, capacity-padded GShard routing: even
exchanges) and Hugging Face Mixtral from the zoo (4 experts, top-2, dropless grouped matmuls:
uneven exchanges).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
NUM_STEPS = 3
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
MOE_SPEC = "moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4,dropout=0.0"


@dataclass(frozen=True)
class Case:
    model: str
    """"moe" (built-in) or an architecture of hf_zoo.py ("Mixtral")."""
    world_size: int
    constraints: dict = field(default_factory=dict)
    known_error: str = ""
    timeout_s: float = 120.0
    """Per case (harness.case_outcome): planning + capture + 3 steps, slow when 4 processes share 2 cores."""


def _batches(generator: torch.Generator):
    return [((torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator),),
             torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)) for _ in range(NUM_STEPS)]


def _workload(name: str):
    """(model, loss_fn, batches of (inputs, targets)); inputs a tuple or a dict of keywords."""
    generator = torch.Generator().manual_seed(1)
    if name == "moe":
        from autopar.models import build_model

        bundle = build_model(MOE_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
        return bundle.model, bundle.loss_fn, _batches(generator)
    import hf_zoo

    arch = next(arch for arch in hf_zoo.ARCHITECTURES if arch.name == name)
    torch.manual_seed(0)
    model = arch.build()
    return model, hf_zoo.loss_for(arch), [hf_zoo.batch(arch, GLOBAL_BATCH, generator) for _ in range(NUM_STEPS)]


def experts_case(case: Case) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model, loss_fn, batches = _workload(case.model)
    reference = train_one_process(model, loss_fn, batches, LEARNING_RATE)
    (inputs, targets), *_ = batches
    # What autopar.parallelize builds; rank 0 exports the model for codegen and the other ranks
    # load it (one_process.py), and the 4-process cases reuse the 2-process cases' captures.
    module = parallelize_reusing_captures(case.model, model, tiny_model_cluster(case.world_size), inputs,
                                          loss_fn=loss_fn, example_targets=targets, constraints=case.constraints)
    # CommDebugMode's module hooks break pipelining: all-to-alls are counted without pp only.
    counter = CommDebugMode() if case.constraints.get("pp", 1) == 1 else None
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    ran = Counter()
    for op, count in (counter.get_comm_counts() if counter is not None else {}).items():
        if "alltoall" in str(op) or "all_to_all" in str(op):
            ran["all_to_all"] += count
    plan = module.plan
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), ep=plan.ep, ep_params=list(plan.ep_params),
                mesh=dict(plan.mesh), num_microbatches=plan.num_microbatches,
                predicted_all_to_all=plan.predicted.collectives_per_microbatch.get("all_to_all", 0),
                ran_all_to_all=ran["all_to_all"])


_FOUR = pytest.mark.skipif(not os.environ.get("AUTOPAR_EP_ALL"), reason="4-process cases: set AUTOPAR_EP_ALL=1")
TABLE = CaseTable([
    case_param(Case("moe", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4)), "moe-dp2-ep2"),
    case_param(Case("Mixtral", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4)), "mixtral-dp2-ep2"),
    # ZeRO-1/2/3: expert weights FSDP-sharded over the dp ranks holding the same experts (here
    # one: dp_rep = 1), the rest over dp.
    *[case_param(Case(model, 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=zero, microbatch_size=4)),
                 f"{model.lower()}-dp2-ep2-zero{zero}") for model in ("moe", "Mixtral") for zero in (1, 2, 3)],
    # 4 processes (minutes on 2 cores): AUTOPAR_EP_ALL=1 runs them.
    # dp4 x ep2 ZeRO-3: dp_rep = 2, the experts really sharded by FSDP.
    case_param(Case("moe", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=3, microbatch_size=2)), "moe-dp4-ep2-zero3",
               _FOUR),
    case_param(Case("Mixtral", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=3, microbatch_size=2)),
               "mixtral-dp4-ep2-zero3", _FOUR),
    case_param(Case("moe", 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0, microbatch_size=4)), "moe-dp2-ep2-tp2", _FOUR),
    case_param(Case("moe", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=2)), "moe-dp4-ep2", _FOUR),
    case_param(Case("moe", 4, dict(dp=2, tp=1, pp=2, ep=2, zero_stage=0, microbatch_size=2)), "moe-dp2-ep2-pp2", _FOUR),
    case_param(Case("Mixtral", 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0, microbatch_size=4)),
               "mixtral-dp2-ep2-tp2", _FOUR),
    # ep x pp under every schedule, with ZeRO (pipelined FSDP2 units of experts and the rest).
    *[case_param(Case(model, 4, dict(dp=2, tp=1, pp=2, ep=2, microbatch_size=2, **extra)),
                 f"{model.lower()}-dp2-ep2-pp2-{name}", _FOUR)
      for model in ("moe", "Mixtral")
      for name, extra in (("1f1b-zero1", dict(schedule="1f1b", zero_stage=1)),
                          ("1f1b-zero3", dict(schedule="1f1b", zero_stage=3)),
                          ("interleaved-zero2", dict(schedule="interleaved", virtual_stages=2, zero_stage=2)),
                          ("zb1p-zero1", dict(schedule="zb1p", zero_stage=1)),
                          ("zbv-zero0", dict(schedule="zbv", zero_stage=0)))],
])
CASES = TABLE.cases


@TABLE.parametrize
def test_expert_parallel_matches_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, experts_case, case_name)
    # Every parameter has its gradient checked on some rank (each pipeline rank holds its stages').
    assert set().union(*(result["grad_errors"] for result in results)) == set(results[0]["all_parameters"])
    for rank, result in enumerate(results):
        assert result["ep"] == case.constraints["ep"] and result["ep_params"], result
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"
        assert result["predicted_all_to_all"] > 0
        if case.constraints["pp"] == 1:  # one microbatch: the step's all-to-alls are one microbatch's
            assert set(result["grad_errors"]) == set(result["all_parameters"])
            assert result["num_microbatches"] == 1
            assert result["ran_all_to_all"] == result["predicted_all_to_all"], result

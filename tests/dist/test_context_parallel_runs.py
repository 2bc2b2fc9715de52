"""Context parallelism runs with the numerics of one device, and its KV collectives are the
ones the plan predicted (autopar/codegen/context_parallel.py).

Each case trains a tiny causal LM (SDPA attention) for a few SGD steps under a forced plan
with cp = 2 (each sequence in 4 chunks, every rank holding 2: load-balanced), alone, with
data parallelism (FSDP over dp x cp), with tensor parallelism and with pipeline stages (ZB-V;
1F1B with GPT's tied embedding), and compares the losses and the first step's gradients with one
process (fp32: float round-off). It also counts the all-gathers of K, V and the reduce-scatters
of their gradients one train_step ran on each rank: its pipeline stage's
`collectives_per_microbatch` times the microbatches.
"""

from __future__ import annotations

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
MODELS = {
    "llama": "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64",
    "gpt": "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0,attention=sdpa",
}


@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    constraints: dict = field(default_factory=dict)
    timeout_s: float = 150.0
    """Each rank exports the model at seq / cp to run it (and rank 0 the whole model, once per model
    and job, for the plan check)."""


class _CallsDuring:
    """The KV collectives `ops` ran inside the `with` block, by kind."""

    def __init__(self, ops) -> None:
        self.ops, self.calls, self._before = ops, {}, {}

    def __enter__(self):
        self._before = dict(self.ops.calls)
        return self

    def __exit__(self, *exc_info) -> None:
        self.calls = {kind: self.ops.calls[kind] - self._before[kind] for kind in self._before}


def cp_case(case: Case) -> dict:
    from autopar.models import build_model

    bundle = build_model(MODELS[case.model], device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator),),
                torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)) for _ in range(NUM_STEPS)]
    reference = train_one_process(bundle.model, bundle.loss_fn, batches, LEARNING_RATE)
    (tokens,), targets = batches[0]
    # What autopar.parallelize(..., precision="fp32") builds; the cases of one model in a job
    # share its whole-model export (the plan check's), each rank still exports its seq / cp share.
    module = parallelize_reusing_captures(case.model, bundle.model, tiny_model_cluster(case.world_size), (tokens,),
                                          loss_fn=bundle.loss_fn, example_targets=targets,
                                          constraints=case.constraints, precision="fp32")
    counted = _CallsDuring(module.context_parallel_ops)
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counted)
    output_error = 0.0
    if module.plan.mesh["pp"] == 1:  # pm(inputs) runs plans without pipeline stages
        with torch.no_grad():
            output_error = (module(tokens) - reference.model(tokens)).abs().max().item()
    plan = module.plan
    # What this rank's pipeline stage runs (the whole model without pipelining).
    predicted = plan.stages[module.runtime.coordinate("pp")].collectives_per_microbatch
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors, mesh=plan.mesh,
                calls=counted.calls, output_error=output_error,
                predicted={"all_gather": predicted.get("cp.kv_all_gather", 0) * plan.num_microbatches,
                           "reduce_scatter": predicted.get("cp.kv_reduce_scatter", 0) * plan.num_microbatches})


def _case(model: str, world_size: int, **constraints):
    return case_param(Case(model, world_size, constraints), f"{model}-" + "-".join(
        f"{k}{v}" for k, v in constraints.items() if k in ("dp", "cp", "tp", "pp", "zero_stage")))


TABLE = CaseTable([
    _case("llama", 2, dp=1, cp=2, tp=1, pp=1, microbatch_size=4),   # rotary tables sliced by position
    _case("gpt", 4, dp=2, cp=2, tp=1, pp=1, zero_stage=3),           # arange positions; FSDP over dp x cp
    _case("llama", 4, dp=1, cp=2, tp=2, pp=1),                       # heads on tp, sequence on cp
    _case("llama", 4, dp=1, cp=2, tp=1, pp=2, microbatch_size=2, schedule="zbv"),  # stages at seq / cp, a V
    _case("gpt", 4, dp=1, cp=2, tp=1, pp=2, microbatch_size=2, schedule="1f1b"),   # tied embedding over stages
])
CASES = TABLE.cases


@TABLE.parametrize
def test_context_parallel_matches_one_device(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, cp_case, case_name)
    for rank, result in enumerate(results):
        assert result["mesh"]["cp"] == 2 and result["mesh"]["tp"] == case.constraints["tp"], result["mesh"]
        assert result["losses"] == pytest.approx(result["reference_losses"], abs=TOLERANCE), f"rank {rank}"
        assert all(error is not None for error in result["grad_errors"].values()), f"rank {rank}: no gradient"
        worst = max(result["grad_errors"].items(), key=lambda item: item[1]["max_abs"])
        assert worst[1]["max_abs"] < TOLERANCE, f"rank {rank}: gradient of {worst[0]} differs: {worst[1]}"
        assert result["output_error"] < TOLERANCE, f"rank {rank}: pm(inputs) differs from one device"
        assert result["calls"] == result["predicted"], f"rank {rank}: KV collectives ran vs predicted"
    assert any(result["calls"]["all_gather"] > 0 for result in results)

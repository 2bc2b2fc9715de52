"""The vocabulary-parallel loss (plan.loss_parallel) trains as one device does.

With a vocabulary large enough that the planner keeps the logits sharded by class into the loss
(32K classes: on `tiny_model_cluster` the whole-logits loss would cost more than the loss's three
small all-reduces), `loss_fn` runs on DTensor logits under loss_parallel (codegen/loss_parallel.py):
without pipelining, on the last pipeline stage of pp x tp, and through a Hugging Face ModelOutput
whose `.logits` the loss reads. Losses of 3 SGD steps, every first-step gradient and the
evaluation loss after them match one process within fp32 round-off; the collectives of a tp step are the ones the plan priced (its
three all-reduces included).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, call, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
NUM_STEPS = 3
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
VOCAB = 32768
SEQ = 16
GPT_SPEC = f"gpt:layers=2,hidden=32,heads=4,seq={SEQ},vocab={VOCAB},dropout=0.0"


def hf_logits_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """A loss as users write it for a Hugging Face causal LM: on the ModelOutput's logits."""
    return F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1))


def _workload(name: str):
    from autopar.models import build_model

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator),),
                torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)) for _ in range(NUM_STEPS)]
    if name == "gpt":
        bundle = build_model(GPT_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
        return bundle.model, bundle.loss_fn, batches
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=False)
    return GPT2LMHeadModel(config), hf_logits_loss, batches


@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    constraints: dict = field(default_factory=dict)


def loss_parallel_case(case: Case) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model, loss_fn, batches = _workload(case.model)
    reference = train_one_process(model, loss_fn, batches, LEARNING_RATE)
    (inputs, targets), *_ = batches
    module = parallelize_reusing_captures(f"vocab-{case.model}", model, tiny_model_cluster(case.world_size), inputs,
                                          loss_fn=loss_fn, example_targets=targets, constraints=case.constraints)
    # CommDebugMode's module tracking fails on a second microbatch: counted with one (tp cases).
    counter = CommDebugMode() if module.plan.num_microbatches == 1 else None
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    eval_loss = module.eval_step(inputs, targets).item()  # the same sharded loss, without autograd
    with torch.no_grad():
        reference_eval_loss = loss_fn(call(reference.model, inputs), targets).item()
    counts = Counter()
    for op, count in (counter.get_comm_counts() if counter else {}).items():
        counts["all_reduce" if "all_reduce" in str(op) else str(op)] += count
    return dict(loss_parallel=module.plan.loss_parallel, losses=run.losses, reference_losses=reference.losses,
                grad_errors=run.grad_errors, all_parameters=sorted(reference.grads),
                fallback=module.loss.fallback_reason if module.loss else None,
                predicted_all_reduce=module.plan.predicted.collectives_per_microbatch.get("all_reduce", 0),
                all_reduce=counts["all_reduce"], pp=module.plan.mesh["pp"],
                num_microbatches=module.plan.num_microbatches, eval_loss=eval_loss,
                reference_eval_loss=reference_eval_loss)


def _case(model: str, world_size: int, **constraints):
    return case_param(Case(model, world_size, constraints),
                      f"{model}-{world_size}-" + "-".join(f"{key}{value}" for key, value in constraints.items()))


TABLE = CaseTable([
    _case("gpt", 2, dp=1, tp=2, pp=1, microbatch_size=GLOBAL_BATCH),
    _case("hf_gpt2", 2, dp=1, tp=2, pp=1, microbatch_size=GLOBAL_BATCH),
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=2, schedule="1f1b"),
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=2, schedule="zbv"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_vocab_parallel_loss_matches_one_device(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, loss_parallel_case, case_name)
    reference = results[0]["reference_losses"]
    for rank, result in enumerate(results):
        assert result["loss_parallel"], "the plan gathers the logits: the case tests nothing"
        assert result["fallback"] is None, f"rank {rank}: the loss fell back to gathered logits: {result['fallback']}"
        assert result["losses"] == pytest.approx(reference, rel=TOLERANCE, abs=TOLERANCE), f"rank {rank}'s losses"
        assert result["eval_loss"] == pytest.approx(result["reference_eval_loss"], rel=TOLERANCE), f"rank {rank}"
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"
        if result["num_microbatches"] == 1:
            assert result["all_reduce"] == result["predicted_all_reduce"], result
    checked = set().union(*(result["grad_errors"] for result in results))
    assert checked == set(results[0]["all_parameters"]), "parameters no rank holds: " \
        f"{sorted(set(results[0]['all_parameters']) - checked)}"

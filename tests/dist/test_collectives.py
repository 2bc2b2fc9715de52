"""The tensor-parallel collectives that run are the ones the plan predicted.

For a tensor-parallel plan (dp = pp = 1, one microbatch, so one `train_step` is one microbatch's
forward + backward), `CommDebugMode` counts the collectives DTensor issues (its functional
collectives); they must equal `plan.predicted.collectives_per_microbatch` kind by kind, and no op
may run with another output placement than the plan chose (`stats.mismatches` is empty).
On a tp-only plan nothing else communicates: no FSDP (dp = 1), no pipeline p2p (pp = 1).

The same step's loss and gradients are compared with one process's. With sequence_parallel=False,
on a cluster whose memory is slow too (harness.tiny_model_cluster(memory_bandwidth_gbs=8), where
vocabulary-parallel embeddings pay), the tiny GPT runs Megatron's tensor parallelism without
sequence parallelism: all-reduces only. With sequence parallelism (allowed, at 2 GB/s) the tiny
GPT and Llama shard their norms by sequence, and the run's all-to-alls (gloo included: DTensor
would all-gather there, codegen/all_to_all.py), reduce-scatters of partial logits into the
vocabulary-parallel loss and all-reduces of the norm weights' partial gradients (in train_step)
are those the plan priced. The counted step is train_step and the optimizer's step: a gradient
left partial would be reduced by the optimizer, and counted.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass

import pytest

from harness import case_outcome, fail, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
TINY_GPT = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0"
TINY_LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64"
# Wide enough that the planner shards it on real A100 figures (Megatron-style, with the
# attention output projection replicated at this size).
MEDIUM_GPT = "gpt:layers=2,hidden=256,heads=4,seq=64,vocab=256,dropout=0.0"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    cluster: str
    """A cluster spec, or "tiny" for harness.tiny_model_cluster."""
    memory_bandwidth_gbs: float | None = None
    """The tiny cluster's memory bandwidth (None: the A100's)."""
    sequence_parallel: bool | None = None
    """The constraint (None: allowed where cheaper)."""
    known_error: str = ""
    """What the failure of a case marked with a known bug says."""
    async_tp: bool = False
    """Run with AUTOPAR_ASYNC_TP=emulate (codegen/async_tp.py's decomposition on gloo)."""
    timeout_s: float = 120.0
    """How long a case may run without progress (planning and tracing a tp4 GPT under load took
    over the harness's default 45 s)."""


_C10D_SPELLING = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}


def collective_kind(op_name: str) -> str:
    """'c10d_functional.all_gather_into_tensor' -> 'all_gather' (c10d's 'allgather_' too)."""
    for c10d_name, kind in _C10D_SPELLING.items():
        op_name = op_name.replace(c10d_name, kind)
    return next((kind for kind in KINDS if kind in op_name), op_name)


def count_case(case: Case) -> dict:
    """What autopar.parallelize builds for the case, counted over one step; the cases of one model
    in a job share its codegen export (`parallelize_reusing_captures`: the planner still plans
    each case for its own cluster on rank 0)."""
    from autopar.models import build_model
    from torch.distributed.tensor.debug import CommDebugMode

    bundle = build_model(case.model, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    (tokens,), targets = bundle.example_inputs, bundle.example_targets
    cluster = tiny_model_cluster(case.world_size, memory_bandwidth_gbs=case.memory_bandwidth_gbs) \
        if case.cluster == "tiny" else case.cluster
    constraints = {"tp": case.world_size, "dp": 1, "pp": 1, "microbatch_size": GLOBAL_BATCH}
    if case.sequence_parallel is not None:
        constraints["sequence_parallel"] = case.sequence_parallel
    batches = [((tokens,), targets)]
    reference = train_one_process(bundle.model, bundle.loss_fn, batches, LEARNING_RATE)
    counter = CommDebugMode()
    with _forced_async_tp(case.async_tp):
        module = parallelize_reusing_captures(case.model, bundle.model, cluster, (tokens,), loss_fn=bundle.loss_fn,
                                              example_targets=targets, constraints=constraints)
        run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    actual = Counter()
    for op, count in counter.get_comm_counts().items():
        actual[collective_kind(str(op))] += count
    return dict(predicted=dict(module.plan.predicted.collectives_per_microbatch), actual=dict(actual),
                partial_grads=run.partial_grads,
                num_microbatches=module.plan.num_microbatches, mismatches=dict(module.stats.mismatches),
                sharded=[name for name, placement in module.plan.param_placements.items() if placement != "R"],
                sequence_parallel=module.plan.sequence_parallel, loss=run.losses[0], reference_loss=reference.losses[0],
                grad_errors=run.grad_errors, async_tp=dict(module.stats.async_tp))


@contextlib.contextmanager
def _forced_async_tp(forced: bool):
    """AUTOPAR_ASYNC_TP=emulate while the case builds and runs its module (codegen/async_tp.py)."""
    if not forced:
        yield
        return
    os.environ["AUTOPAR_ASYNC_TP"] = "emulate"
    try:
        yield
    finally:
        del os.environ["AUTOPAR_ASYNC_TP"]


TABLE = CaseTable([
    case_param(Case(TINY_GPT, 2, "tiny"), "gpt-tp2"),
    case_param(Case(TINY_GPT, 4, "tiny"), "gpt-tp4"),
    # On real A100 figures a tiny model is replicated: nothing predicted, nothing may run.
    case_param(Case(TINY_GPT, 4, "dgx-a100-80g:gpus_per_node=4"), "gpt-tp4-dgx-replicated"),
    case_param(Case(MEDIUM_GPT, 2, "dgx-a100-80g:gpus_per_node=2", known_error="predicted - ran: {'all_reduce': 2}"),
               "gpt256-tp2-dgx"),
    case_param(Case(TINY_GPT, 2, "tiny", memory_bandwidth_gbs=8, sequence_parallel=False), "gpt-tp2-no-sp"),
    # RMS norms: DTensor would carry the partial gradients of the replicated residual stream on
    # through their backward (interpreter.pin_grad).
    case_param(Case(TINY_LLAMA, 2, "tiny", memory_bandwidth_gbs=8, sequence_parallel=False), "llama-tp2-no-sp"),
    # Sequence parallelism allowed (the default) where memory-bound norms are worth splitting.
    case_param(Case(TINY_GPT, 2, "tiny", memory_bandwidth_gbs=2), "gpt-tp2-sp"),
    case_param(Case(TINY_LLAMA, 2, "tiny", memory_bandwidth_gbs=2), "llama-tp2-sp"),
    # Async TP, emulated: the sequence-parallel all-gathers and reduce-scatters run inside the
    # column- and row-parallel linears (codegen/async_tp.py), the same kinds and counts.
    case_param(Case(TINY_LLAMA, 2, "tiny", memory_bandwidth_gbs=2, async_tp=True), "llama-tp2-sp-async"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_collectives_match_prediction(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, count_case, case_name)
    for rank, result in enumerate(results):
        assert result["num_microbatches"] == 1
        assert result["mismatches"] == {}, f"rank {rank}: ops ran with other placements than planned"
        predicted, actual = result["predicted"], result["actual"]
        if actual != {kind: count for kind, count in predicted.items() if count}:
            excess = {kind: predicted.get(kind, 0) - actual.get(kind, 0) for kind in sorted({*predicted, *actual})
                      if predicted.get(kind, 0) != actual.get(kind, 0)}
            fail(f"rank {rank}: collectives per microbatch, predicted {predicted}, ran {actual}: "
                 f"predicted - ran: {excess}", case.known_error)


def test_tiny_model_cluster_gives_tensor_parallelism(case_outcome):
    """The counts above are only meaningful if the plan shards something and predicts collectives."""
    outcome = case_outcome(count_case, CASES, "gpt-tp2")
    assert outcome.ok, outcome.error
    assert outcome.values[0]["sharded"], "the plan shards no parameter"
    assert sum(outcome.values[0]["predicted"].values()) > 0


@pytest.mark.parametrize("case_name", ["gpt-tp2-no-sp", "llama-tp2-no-sp"])
def test_without_sequence_parallelism_all_reduces_and_matches_one_process(case_name, case_outcome):
    """Megatron's tensor parallelism without sequence parallelism, as the plan asked codegen for
    it: all-reduces (and at most one all-gather, of a hidden-sharded embedding) run, kind by
    kind the plan's prediction (test above), the plan shards the weights, and the step gives one
    process's loss and gradients."""
    outcome = case_outcome(count_case, CASES, case_name)
    assert outcome.ok, outcome.error
    for rank, result in enumerate(outcome.values):
        assert result["sequence_parallel"] is False
        assert "reduce_scatter" not in result["actual"], f"rank {rank}: {result['actual']}"
        assert result["actual"].get("all_reduce", 0) > 0, f"rank {rank}: {result['actual']}"
        # At most one all-gather: an embedding sharded on its hidden dim (its optimizer step halved;
        # the tiny cases' 4 GB/s memory makes that worth a gather of its output).
        assert set(result["actual"]) <= {"all_reduce", "all_gather"}, f"rank {rank}: {result['actual']}"
        assert result["actual"].get("all_gather", 0) <= 1, f"rank {rank}: {result['actual']}"
        assert_one_process_numerics(rank, result)


@pytest.mark.parametrize("case_name", ["gpt-tp2-sp", "llama-tp2-sp", "llama-tp2-sp-async"])
def test_sequence_parallelism_runs_its_collectives_and_matches_one_process(case_name, case_outcome):
    """Sequence parallelism, the default path of large models: the plan shards the norms'
    activations on the sequence (reduce-scatters, all-gathers), moves shards between dims with
    all-to-alls (GPT: into and out of its hidden-sharded embeddings and tied head) and reduces
    the norm weights' partial gradients in the step; the step gives one process's loss and
    gradients. Kind by kind the plan's prediction: test_collectives_match_prediction."""
    outcome = case_outcome(count_case, CASES, case_name)
    assert outcome.ok, outcome.error
    for rank, result in enumerate(outcome.values):
        assert result["sequence_parallel"] is True
        assert result["predicted"].get("reduce_scatter", 0) > 0, f"rank {rank}: no sequence shard: {result}"
        if case_name.startswith("gpt"):
            assert result["predicted"].get("all_to_all", 0) > 0, f"rank {rank}: no shard-dim change: {result}"
        # Reduced in train_step, where the plan priced it, not left to the optimizer's update.
        assert result["partial_grads"] == [], f"rank {rank}: gradients left partial: {result['partial_grads']}"
        assert_one_process_numerics(rank, result)


def test_async_tp_fuses_the_linears_and_matches_the_dtensor_path(case_outcome):
    """The emulated async TP runs the tiny Llama's column- and row-parallel linears fused (none
    falls back) and its step gives the DTensor path's loss."""
    fused = case_outcome(count_case, CASES, "llama-tp2-sp-async")
    plain = case_outcome(count_case, CASES, "llama-tp2-sp")
    assert fused.ok and plain.ok, (fused.error, plain.error)
    for rank, (result, reference) in enumerate(zip(fused.values, plain.values)):
        assert result["async_tp"].get("column", 0) > 0 and result["async_tp"].get("row", 0) > 0, (rank, result)
        assert result["async_tp"].get("fallback", 0) == 0, (rank, result["async_tp"])
        assert reference["async_tp"] == {}
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-6)


def assert_one_process_numerics(rank: int, result: dict) -> None:
    assert result["sharded"], "the plan shards no parameter: it tests nothing"
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=TOLERANCE, abs=TOLERANCE)
    assert result["grad_errors"], "no gradient compared"
    for parameter, error in result["grad_errors"].items():  # fp32 throughout: round-off only
        assert error is not None and error["max_abs"] <= TOLERANCE, (rank, parameter, error)
        assert error["norm"] <= TOLERANCE * max(error["reference_norm"], 1.0), (rank, parameter, error)

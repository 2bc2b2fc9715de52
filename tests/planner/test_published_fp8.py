"""benchmarks/published_fp8.py: published FP8 runs (benchmarks/published_fp8.csv) priced as run.

Every row is read in published_runs.csv's format and priced in fp8 with the cast handling of its
framework (a stated input of the price), beside autopar's runtime (compiled and eager casts) and bf16. No accuracy is
asserted here against the published figures (BENCHMARKS.md records the table): the rows are
data, and what is checked is that each one prices as the framework ran it."""

import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.published_fp8 import REFERENCE, evaluate_fp8, handling_of, read_fp8_runs, recipe_of

pytestmark = pytest.mark.slow

RUNS = read_fp8_runs(REFERENCE)


@pytest.fixture(scope="module")
def outcomes():
    with tempfile.TemporaryDirectory() as directory:
        return {run.id: evaluate_fp8(run, Path(directory)) for run in RUNS}


def test_the_file_has_the_published_runs_format_and_unique_rows():
    assert len(RUNS) >= 6 and len({run.id for run in RUNS}) == len(RUNS)
    for run in RUNS:
        assert recipe_of(run) in ("tensorwise", "rowwise")
        assert run.tp * run.pp * run.dp * run.cp == run.gpus, run.id
        assert run.global_batch % (run.microbatch * run.dp) == 0, run.id


def test_each_framework_is_priced_with_its_cast_handling():
    handlings = {run.id: handling_of(run) for run in RUNS}
    # torchtitan's 2024 tables ran torchao from before 2025-01-13: its float8 linear saved float8
    # operands; the 2025 tables' torchao saves the high-precision ones and casts again
    titans = {run.id: "of 2024-" in run.source for run in RUNS if "torchtitan" in run.source}
    assert {handlings[name] for name, old in titans.items() if old} == {"torchtitan-2024"}
    assert {handlings[name] for name, old in titans.items() if not old} == {"torchtitan"}
    titan = next(run for run in RUNS if "torchtitan" in run.source)
    later = replace(titan, source=titan.source.replace("torchao eab345c of 2024-12-23", "torchao 0cf1281 of 2025-06-01"))
    assert handling_of(later) == "torchtitan"
    assert {handlings[run.id] for run in RUNS if "NeMo" in run.source} == {"te"}
    assert {handlings[run.id] for run in RUNS if "Megatron-Bridge" in run.source} == {"te-current"}


def test_megatron_bridge_rows_reduce_bf16_gradients_as_its_performance_configs_set():
    """Megatron-Bridge's performance configurations set grad_reduce_in_fp32 False: bf16
    gradient buffers, reduce-scattered in bf16; other Megatron-Core rows keep their handling."""
    from benchmarks.published_runs import policy_of

    bridge = [run for run in RUNS if "Megatron-Bridge" in run.source]
    assert bridge
    for run in bridge:
        assert policy_of(run).grad_bytes == policy_of(run).dp_reduce_bytes == 2.0, run.id
    nemo = next(run for run in RUNS if run.id == "nemo-llama3-70b-fp8")
    assert policy_of(nemo).dp_reduce_bytes == 4.0
    said = next(run for run in RUNS if run.id == "nemo-b200-llama3-70b-fp8")  # NeMo's scripts, where the notes say so
    assert "grad_reduce_in_fp32 False" in said.notes and policy_of(said).dp_reduce_bytes == 2.0


@pytest.mark.parametrize("name", [run.id for run in RUNS])
def test_every_row_is_predicted_to_fit(outcomes, name):
    estimate = outcomes[name].estimate
    assert estimate.fits, f"{name} ran, so it must be predicted to fit: {estimate.memory_bytes}"


@pytest.mark.parametrize("name", [run.id for run in RUNS])
def test_every_row_prices(outcomes, name):
    outcome = outcomes[name]
    estimate = outcome.estimate
    assert math.isfinite(outcome.predicted) and outcome.predicted > 0
    assert estimate.breakdown_s["fp8.matmul"] > 0 and estimate.breakdown_s["fp8.cast"] > 0
    assert estimate.breakdown_s["compute"] >= 0 and estimate.breakdown_s.get("recompute", 0.0) >= 0
    # The handling is an input: the framework's fused casts cost less than autopar's eager ones, and
    # autopar's compiled casts as little as torchtitan's (whose float8 tp gathers it does not run).
    assert outcome.eager.breakdown_s["fp8.cast"] > estimate.breakdown_s["fp8.cast"]
    assert outcome.compiled.breakdown_s["fp8.cast"] < outcome.eager.breakdown_s["fp8.cast"]
    titan = outcome.handling.startswith("torchtitan")
    if not titan or outcome.run.cp == 1:  # the casts are all that differ
        assert outcome.eager.step_time_s > estimate.step_time_s
    if titan and outcome.run.cp == 1:
        assert outcome.compiled.step_time_s >= estimate.step_time_s
    if titan and outcome.run.cp > 1:  # torch's context_parallel, compiled: its
        # exchange waited where issued (published_runs.cp_kv_exchange_of); autopar's runtime gathers its own way
        assert estimate.breakdown_s["cp.dkv_ring"] > 0 and "cp.dkv_ring" not in outcome.compiled.breakdown_s
    # DTensor's sequence-parallel collectives (torchtitan, torch of 2024-12) copy their chunks into place;
    # Megatron's (seq, batch, hidden) layout does not.
    copies = [name for name in estimate.breakdown_s if name.startswith("tp.layout_copy")]
    assert bool(copies) == (titan and outcome.run.tp > 1), (name, copies)
    # On H100s the same plan is priced faster in fp8 (as run) than in bf16.
    assert outcome.bf16 is not None and estimate.step_time_s < outcome.bf16.step_time_s


def test_rows_that_ran_torchs_async_tp_price_faster_with_it_and_the_others_do_not_move():
    """`--async-tp`: a row whose notes say "AsyncTP on" priced with torch's async TP
    (PrecisionPolicy.with_torch_async_tp) instead of its TP collectives exposed; a row without it
    prices the same."""
    ran = next(run for run in RUNS if run.async_tp and run.pp == 1)
    off = next(run for run in RUNS if not run.async_tp and run.tp > 1 and "torchtitan" in run.source)
    with tempfile.TemporaryDirectory() as directory:
        exposed, overlapped = (evaluate_fp8(ran, Path(directory), with_bf16=False, async_tp=flag).estimate
                               for flag in (False, True))
        same = [evaluate_fp8(off, Path(directory), with_bf16=False, async_tp=flag).estimate.step_time_s
                for flag in (False, True)]
    assert overlapped.step_time_s < exposed.step_time_s
    assert overlapped.breakdown_s["tp.sm_contention"] > 0 and "tp.sm_contention" not in exposed.breakdown_s
    assert same[0] == same[1]


def test_a_gpt_row_is_built_with_the_dropout_its_notes_state():
    """NeMo 2.0's GPTConfig175B sets hidden and attention dropout 0.0; its 5B and 20B keep
    Megatron-Core's 0.1, the built-in GPT's default, which rows without a stated dropout get."""
    by_id = {run.id: run for run in RUNS}
    assert by_id["nemo-gpt3-175b-fp8"].model.endswith(",dropout=0.0")
    assert "dropout" not in by_id["nemo-gpt3-5b-fp8"].model
    assert by_id["dgxc-gpt3-175b-128-fp8"].dropout == 0.1

"""benchmarks/published_bf16.csv: published bf16 runs beyond the shared sample, priced as run.

The rows are data (BENCHMARKS.md records each one's error); what is checked here is that they
are read in the shared file's format, that NeMo 1.0's distributed fused Adam holds its states as
that optimizer does, and that a configuration which ran is predicted to fit."""

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.published_runs import (DISTRIBUTED_FUSED_ADAM_GRAD_BYTES, DISTRIBUTED_FUSED_ADAM_OPTIMIZER_BYTES,
                                       MEGATRON_BF16_MAIN_GRAD_BYTES, MORE_BF16, evaluate_run, policy_of, read_runs)

RUNS = {run.id: run for run in read_runs(MORE_BF16)}


def test_the_file_has_the_published_runs_format_and_unique_rows():
    assert len(RUNS) >= 4
    for run in RUNS.values():
        assert run.precision in ("bf16", "mixed"), run.id
        assert run.metric in ("step_time_s", "tokens_per_s_per_gpu"), run.id
        assert run.tp * run.pp * run.dp * run.cp == run.gpus, run.id
        assert run.global_batch % (run.microbatch * run.dp) == 0, run.id


def test_nemo_distributed_fused_adam_holds_bf16_gradients_and_16_bit_master_remainders():
    """Apex's DistributedFusedAdam, as NeMo 1.0 configures it: a full-size gradient buffer in
    grad_sync_dtype (bf16), reduce-scattered so; Adam's moments plus the low 16 bits of each
    fp32 master weight, unless fp8_params makes it store fp32 masters."""
    run = RUNS["dgxc-llama31-8b-8"]
    assert run.distributed_fused_adam
    policy = policy_of(run)
    assert policy.grad_bytes == policy.dp_reduce_bytes == DISTRIBUTED_FUSED_ADAM_GRAD_BYTES == 2.0
    assert policy.optimizer_bytes == DISTRIBUTED_FUSED_ADAM_OPTIMIZER_BYTES == 10.0
    assert policy_of(RUNS["dgxc-gpt3-175b-128"]).optimizer_bytes == 12.0  # fp8_params: fp32 masters
    megatron = replace(run, notes="NeMo/Megatron-Core; distributed optimizer (ZeRO-1)")
    assert not megatron.distributed_fused_adam
    assert policy_of(megatron).grad_bytes == MEGATRON_BF16_MAIN_GRAD_BYTES


@pytest.mark.slow
def test_the_llama_3_1_8b_recipe_that_ran_on_80_gb_is_predicted_to_fit():
    """Priced with Megatron-Core's fp32 main gradients, this configuration (tp 1, cp 2, no
    recomputation) came out at 81 GiB, over an 80 GB H100: the bf16 buffer is what let it run."""
    run = RUNS["dgxc-llama31-8b-8"]
    with tempfile.TemporaryDirectory() as directory:
        as_run = evaluate_run(run, Path(directory)).estimate
        fp32 = evaluate_run(replace(run, notes="NeMo/Megatron-Core; CP 2"), Path(directory)).estimate
    assert as_run.fits and not fp32.fits
    assert as_run.memory_bytes["gradients"] == pytest.approx(fp32.memory_bytes["gradients"] / 2)

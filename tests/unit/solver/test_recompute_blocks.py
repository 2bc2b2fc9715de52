"""Full recomputation of some blocks (solver/recompute_blocks.py, "blocks:<N>"): which segments it
recomputes per model chunk, its refusals, and its price between "none" and "full"."""

import pytest

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.plans.plan import Plan
from autopar.solver.recompute_blocks import (block_count, blocks_blocker, blocks_mode, holds_others,
                                             recomputed_flags, segment_mode)
from autopar.solver.recompute_modules import check_recompute, lighter_modes

LLAMA = "llama:layers=4,hidden=1024,heads=8,kv_heads=4,ffn_hidden=2816,vocab=4096,seq=2048"
ONE_H100 = "dgx-h100:nodes=1,gpus_per_node=1"
# embedding, four blocks, head and loss
SEGMENTS = (False, True, True, True, True, False)


def test_the_mode_parses_and_refuses_what_is_not_a_count():
    assert block_count("blocks:5") == 5 and blocks_mode(5) == "blocks:5"
    assert check_recompute("blocks:3") == "blocks:3"
    for bad in ("blocks:0", "blocks:x", "blocks:", "blocks:-1"):
        with pytest.raises(ConfigError, match="blocks:N"):
            check_recompute(bad)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="whole number of blocks"):
            blocks_mode(bad)
    assert lighter_modes("blocks:2") == ("none", "gathers")
    assert segment_mode("blocks:2", "b", frozenset({"b"})) == "full"
    assert segment_mode("blocks:2", "c", frozenset({"b"})) == "none" and segment_mode("op", "c", frozenset()) == "op"


def test_the_first_blocks_of_each_chunk_are_recomputed():
    assert recomputed_flags(SEGMENTS, num_chunks=1, split="balanced", mode="blocks:2") == (
        False, True, True, False, False, False)
    # two chunks of two blocks (the balanced cut counts blocks as the uniform one)
    assert recomputed_flags(SEGMENTS, num_chunks=2, split="balanced", mode="blocks:1") == (
        False, True, False, True, False, False)
    assert recomputed_flags(SEGMENTS, num_chunks=2, split="first=1,last=3", mode="blocks:1") == (
        False, True, True, False, False, False)
    assert holds_others(SEGMENTS, num_chunks=2, split="uniform", mode="blocks:1")
    assert not holds_others(SEGMENTS, num_chunks=2, split="uniform", mode="blocks:2")  # whole chunks


def test_a_count_beyond_a_chunk_or_a_model_without_blocks_is_refused():
    with pytest.raises(ConfigError, match="model chunk 0 of 2 holds 2 block"):
        recomputed_flags(SEGMENTS, num_chunks=2, split="uniform", mode="blocks:3")
    assert "holds 1 block" in blocks_blocker(SEGMENTS, num_chunks=2, split="first=1,last=3", mode="blocks:2")
    assert blocks_blocker(SEGMENTS, num_chunks=2, split="uniform", mode="blocks:2") == ""
    with pytest.raises(ConfigError, match="no segment repeats"):
        recomputed_flags((False, False), num_chunks=1, split="balanced", mode="blocks:1")


def _evaluate(recompute: str, **fixed):
    return autopar.evaluate(LLAMA, cluster=ONE_H100, global_batch=4, microbatch_size=4, recompute=recompute, **fixed)


def test_the_price_lies_between_none_and_full_by_the_blocks_recomputed():
    """Each recomputed block adds its forward to the step and takes its activations (but its input)
    off the peak; the kept blocks behind it free room for what it regenerates (no workspace)."""
    none, one, two, full = (_evaluate(mode) for mode in ("none", "blocks:1", "blocks:2", "full"))
    steps = [plan.predicted.step_time_s for plan in (none, one, two, full)]
    peaks = [plan.predicted.peak_memory_bytes for plan in (none, one, two, full)]
    assert steps == sorted(steps) and peaks == sorted(peaks, reverse=True)
    per_block = one.predicted.breakdown_s["recompute"] - none.predicted.breakdown_s.get("recompute", 0.0)
    assert per_block > 0
    assert two.predicted.breakdown_s["recompute"] - none.predicted.breakdown_s.get("recompute", 0.0) == \
        pytest.approx(2 * per_block)
    assert one.recompute == "blocks:1" and Plan.from_dict(one.to_dict()).recompute == "blocks:1"


def test_with_pipelining_each_chunk_recomputes_its_own_first_blocks():
    fixed = dict(cluster="dgx-h100:nodes=1,gpus_per_node=2", global_batch=8, microbatch_size=1, pp=2,
                 pipeline_split="uniform")
    none, one = (autopar.evaluate(LLAMA, recompute=mode, **fixed) for mode in ("none", "blocks:1"))
    for stage, base in zip(one.stages, none.stages):
        assert stage.memory_bytes["activations"] < base.memory_bytes["activations"]
        times = stage.chunk_times_s[0]
        assert times["recompute"] > base.chunk_times_s[0].get("recompute", 0.0)
    with pytest.raises(ConfigError, match="holds 2 block"):
        autopar.evaluate(LLAMA, recompute="blocks:3", **fixed)


def test_the_search_takes_the_mode_as_a_constraint():
    plan = autopar.plan(LLAMA, cluster="dgx-h100:nodes=1,gpus_per_node=2", global_batch=8,
                        constraints={"recompute": "blocks:1", "pp": 2})
    assert plan.recompute == "blocks:1" and plan.mesh["pp"] == 2


def test_fp8_prices_the_recomputed_blocks_forward_matmuls_again():
    """Under precision fp8 a recomputed block's float8 linears run their forward matmul twice."""
    fixed = dict(precision="fp8", fp8_filter=lambda fqn, shape: True)
    none, one, full = (_evaluate(mode, **fixed) for mode in ("none", "blocks:1", "full"))
    matmul = [plan.predicted.breakdown_s["fp8.matmul"] for plan in (none, one, full)]
    assert matmul[0] < matmul[1] < matmul[2]


def test_a_search_left_with_nothing_says_which_chunk_holds_too_few_blocks():
    with pytest.raises(InfeasiblePlanError, match=r"recompute=blocks:3: recompute 'blocks:3': model chunk 0 of 2 holds 2 "):
        autopar.plan(LLAMA, cluster="dgx-h100:nodes=1,gpus_per_node=2", global_batch=8,
                     constraints={"recompute": "blocks:3", "pp": 2})

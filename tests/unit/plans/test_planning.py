"""Precision "fp8" and the pipeline split through plan and evaluate (plans/planning.py): recorded
choice, refusals."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError, PlanMismatchError
from autopar.plans import planning
from autopar.plans.plan import Plan
from autopar.solver.constraints import Constraints

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64"


def test_an_fp8_plan_records_its_recipe_and_linears_and_reads_back():
    plan = autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8", fp8_recipe="rowwise")
    assert plan.precision == "fp8" and plan.fp8_recipe == "rowwise"
    assert len(plan.fp8_linears) == 12 and "wte.weight" not in plan.fp8_linears
    again = Plan.from_dict(plan.to_dict())
    assert again.fp8_linears == plan.fp8_linears and again.fp8_recipe == "rowwise"
    assert again.fp8_casts == plan.fp8_casts == "eager"
    with pytest.raises(PlanMismatchError, match="fp8_casts='jit'; expected one of '', 'compiled', 'eager'"):
        Plan.from_dict({**plan.to_dict(), "fp8_casts": "jit"})
    assert autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8).fp8_linears == ()


BIG = "gpt:layers=1,hidden=16384,heads=128,seq=4096,vocab=1024"


def test_on_fp8_tensor_cores_the_planner_keeps_float8_where_it_is_faster():
    """torchao's eager casts cost memory passes that only large matmuls repay: the 16384 x 65536
    MLP linears at 16,384 tokens run in float8, the attention's 16384 x 16384 ones only with the
    casts compiled; a 64-wide model's linears stay in bf16 either way."""
    fixed = dict(cluster="dgx-h100:gpus_per_node=1", global_batch=4, microbatch_size=4)
    big = autopar.evaluate(BIG, **fixed, precision="fp8", fp8_casts="eager")
    assert big.fp8_linears == ("layers.0.mlp.fc_in.weight", "layers.0.mlp.fc_out.weight")
    bf16 = autopar.evaluate(BIG, **fixed)
    assert big.predicted.step_time_s < bf16.predicted.step_time_s
    compiled = autopar.evaluate(BIG, **fixed, precision="fp8")
    assert compiled.fp8_casts == "compiled" and len(compiled.fp8_linears) == 6  # q, k, v, o, fc_in, fc_out
    assert compiled.predicted.step_time_s < big.predicted.step_time_s
    tiny = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8")
    assert tiny.fp8_linears == () and any("0 of 12 eligible linears" in note for note in tiny.notes)
    # A filter is the user's choice: kept as given.
    forced = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8",
                              fp8_filter=lambda fqn, shape: True)
    assert len(forced.fp8_linears) == 12


LLAMA3_8B = "llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn_hidden=14336,vocab=128256,seq=8192"
"""Llama 3 8B's layer shape (2 of its 32 layers) at its 8,192-token sequence."""
SMALL_LLAMA = "llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn_hidden=1024,vocab=1024,seq=512"


def test_the_planner_picks_fp8_for_llama_3_8b_on_h100s_with_compiled_casts():
    """With the casts compiled (the runtime's default on GPUs) float8 pays for Llama 3 8B's large
    linears: the search keeps q, o and the MLP's in float8 (as priced today: the 4096 x 1024 k and v
    projections stay bf16, their casts priced above what their matmuls save) and prices the step
    below bf16's. With eager casts
    (33 bytes per element in 9 kernels) nothing pays."""
    plan = autopar.plan(LLAMA3_8B, cluster="dgx-h100", global_batch=8, precision="fp8")
    assert plan.fp8_casts == "compiled"
    kept = {name.split(".", 2)[2] for name in plan.fp8_linears}
    assert kept >= {"attn.q_proj.weight", "attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                    "mlp.down_proj.weight"}, plan.fp8_linears
    assert len(plan.fp8_linears) >= 10  # both layers'
    fixed = dict(cluster="dgx-h100", global_batch=8, tp=plan.mesh["tp"], pp=plan.mesh["pp"], cp=plan.mesh["cp"],
                 dp=plan.mesh["dp"], microbatch_size=plan.microbatch_size, recompute=plan.recompute,
                 zero_stage=plan.zero_stage)
    bf16 = autopar.evaluate(LLAMA3_8B, **fixed)
    assert plan.predicted.step_time_s < bf16.predicted.step_time_s
    bought = [note for note in plan.notes if note.startswith("fp8 buys")]
    assert len(bought) == 1 and f"{len(plan.fp8_linears)} of 14 eligible linears" in bought[0]
    assert "compiled casts" in bought[0]
    assert "; saves " in bought[0]
    eager = autopar.evaluate(LLAMA3_8B, **fixed, precision="fp8", fp8_casts="eager")
    assert eager.fp8_casts == "eager" and eager.fp8_linears == ()
    # fp8 plans run sequence parallelism's collectives through DTensor (no async TP): as bf16's "off"
    exposed = autopar.evaluate(LLAMA3_8B, **fixed, tp_overlap="off")
    assert eager.predicted.step_time_s == pytest.approx(exposed.predicted.step_time_s)


def test_the_planner_keeps_a_small_hidden_model_in_bf16_even_with_compiled_casts():
    """At hidden 256 a cast's fixed kernel cost and memory pass outweigh the float8 matmul's saving."""
    plan = autopar.plan(SMALL_LLAMA, cluster="dgx-h100", global_batch=8, precision="fp8")
    assert plan.fp8_casts == "compiled" and plan.fp8_linears == ()
    assert any(note.startswith("fp8 buys: 0 of 14 eligible linears") and "runs in bf16" in note
               for note in plan.notes)


def test_a_model_without_eligible_linears_is_told_so():
    """Hidden 24 is no multiple of 16: no linear can run in float8, whatever the casts cost."""
    plan = autopar.evaluate("gpt:layers=1,hidden=24,heads=2,seq=16,vocab=64", cluster="dgx-h100", global_batch=8,
                            precision="fp8")
    bought = [note for note in plan.notes if note.startswith("fp8 buys")]
    assert plan.fp8_linears == () and len(bought) == 1
    assert "0 of 0 eligible linears" in bought[0] and "no linear is eligible" in bought[0]
    assert "would cost more" not in bought[0]


def test_the_cast_handling_defaults_by_device_and_is_refused_without_fp8():
    assert autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8").fp8_casts == "eager"
    assert autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8",
                            fp8_casts="compiled").fp8_casts == "compiled"
    assert autopar.evaluate(GPT, cluster="cpu", global_batch=8).fp8_casts == ""
    with pytest.raises(ConfigError, match="fp8_casts"):
        autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8", fp8_casts="jit")
    with pytest.raises(ConfigError, match="pass precision='fp8' or drop fp8_casts"):
        autopar.evaluate(GPT, cluster="cpu", global_batch=8, fp8_casts="eager")
    with pytest.raises(ConfigError, match="pass precision='fp8' or drop fp8_recipe"):
        autopar.evaluate(GPT, cluster="cpu", global_batch=8, fp8_recipe="rowwise")


def test_a_filter_chooses_the_linears():
    plan = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8",
                            fp8_filter=lambda fqn, shape: fqn.endswith("fc_in"))  # kept as given
    assert plan.fp8_linears == ("layers.0.mlp.fc_in.weight", "layers.1.mlp.fc_in.weight")


ODD_LLAMA = "llama:layers=1,hidden=48,heads=4,kv_heads=2,seq=16,vocab=50"


def test_a_filter_that_raises_is_refused_with_the_weight_it_was_asked_about():
    with pytest.raises(ConfigError, match=r"fp8_filter\('layers.0.attn.q_proj', \(48, 48\)\) raised TypeError"):
        autopar.evaluate(ODD_LLAMA, cluster="cpu", global_batch=8, precision="fp8", fp8_filter=lambda fqn: True)


@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "p3-16xlarge"])
def test_gpus_without_fp8_tensor_cores_are_refused_with_the_reason(cluster):
    with pytest.raises(ConfigError, match="needs FP8 tensor cores"):
        autopar.evaluate(GPT, cluster=cluster, global_batch=8, precision="fp8")


def test_a_cluster_file_may_give_a_device_fp8_tensor_cores(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('preset = "dgx-a100-80g"\n[device]\nfp8_tflops = 624\n')
    assert autopar.Cluster.from_spec(str(path)).device.has_fp8
    assert autopar.evaluate(GPT, cluster=str(path), global_batch=8, precision="fp8").precision == "fp8"


def test_cpu_clusters_run_fp8_emulated_and_bad_arguments_are_named():
    assert autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8").precision == "fp8"
    with pytest.raises(ConfigError, match="fp8_recipe"):
        autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8", fp8_recipe="blockwise")
    with pytest.raises(ConfigError, match="precision='fp8'"):
        autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, fp8_filter=lambda fqn, shape: True)


def test_a_plan_file_with_an_unknown_recipe_is_refused():
    data = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8").to_dict()
    data["fp8_recipe"] = "blockwise"
    with pytest.raises(Exception, match="fp8_recipe"):
        Plan.from_dict(data)


def test_the_search_prices_float8_and_keeps_the_faster_plan():
    """The search prices every configuration with its float8 linears (its pruning bound allows for
    matmuls up to the fp8/bf16 peak ratio faster): the fp8 plan beats the bf16 plan."""
    fp8 = autopar.plan(BIG, cluster="dgx-h100", global_batch=16, precision="fp8")
    bf16 = autopar.plan(BIG, cluster="dgx-h100", global_batch=16)
    assert fp8.fp8_linears and fp8.predicted.step_time_s < bf16.predicted.step_time_s
    assert fp8.predicted.breakdown_s["fp8.matmul"] > 0


# --- the pipeline split ------------------------------------------------------------------------


def _split_plan(split: str, pp: int = 4, **fixed):
    from report_plans import planner

    fixed = {"schedule": "1f1b", "virtual_stages": None, **fixed}
    config = planning.fixed_config(planner(), tp=1, pp=pp, dp=None, microbatch_size=1, layers_per_virtual_stage=None,
                                   recompute="none", zero_stage=0, pipeline_split=split, **fixed)
    return planning.evaluate_with(planner(), config)


def test_evaluate_cuts_the_stages_the_split_names_and_records_it():
    plan = _split_plan("first=1,last=3")
    assert [stage.segments for stage in plan.stages] == [
        ("prologue", "layers.0"), ("layers.1", "layers.2"), ("layers.3", "layers.4"), ("layers.5", "layers.6", "layers.7", "epilogue")]
    assert plan.pipeline_split == "first=1,last=3" and "stages cut by count (first=1,last=3)" in plan.summary()
    assert Plan.from_dict(plan.to_dict()).pipeline_split == "first=1,last=3"
    assert Plan.from_dict({key: value for key, value in plan.to_dict().items()
                           if key != "pipeline_split"}).pipeline_split == "balanced"  # plans written before it
    with pytest.raises(PlanMismatchError, match="pipeline_split must be"):
        Plan.from_dict({**plan.to_dict(), "pipeline_split": "even"})
    interleaved = _split_plan("uniform", pp=2, schedule="interleaved", virtual_stages=2)
    assert [stage.chunks for stage in interleaved.stages] == [
        (("prologue", "layers.0", "layers.1"), ("layers.4", "layers.5")),
        (("layers.2", "layers.3"), ("layers.6", "layers.7", "epilogue"))]


def test_a_split_the_blocks_do_not_divide_is_refused_with_the_counts():
    with pytest.raises(ConfigError, match="8 repeated blocks \\+ the embedding \\+ the head = 10 does not divide by 4"):
        _split_plan("uniform:embedding,head")
    with pytest.raises(ConfigError, match="pipeline_split must be"):
        autopar.evaluate(GPT, cluster="cpu:procs=2", global_batch=8, pp=2, pipeline_split="even")


def test_plan_searches_only_the_pipelines_the_split_divides():
    from report_plans import planner

    plan = planning.plan_with(planner(), Constraints(pp=4, pipeline_split="uniform"))
    assert plan.pipeline_split == "uniform"
    assert [len(stage.segments) for stage in plan.stages] == [3, 2, 2, 3]
    with pytest.raises(InfeasiblePlanError, match="no configuration satisfies pp=4, pipeline_split=uniform:embedding"
                                                  ",head: pipeline_split 'uniform:embedding,head' puts"):
        planning.plan_with(planner(), Constraints(pp=4, pipeline_split="uniform:embedding,head"))
    with pytest.raises(ConfigError, match="constraints\\['pipeline_split'\\] must be"):
        autopar.plan(GPT, cluster="cpu:procs=2", global_batch=8, constraints={"pipeline_split": "even"})


# --- async TP (Plan.tp_overlap) ----------------------------------------------------------------

WIDE_LLAMA = "llama:layers=1,hidden=2048,heads=16,ffn_hidden=5504,seq=2048,vocab=256"


def test_async_tp_is_the_default_on_cuda_and_prices_sp_collectives_hidden():
    """A CUDA cluster's SP plan runs async TP and is priced below the same plan with DTensor's
    exposed collectives (solver/tp_overlap.py); tp=1 and CPU clusters stay "off"."""
    fused = autopar.evaluate(WIDE_LLAMA, cluster="dgx-h100", global_batch=8, tp=8, pp=1, microbatch_size=1)
    exposed = autopar.evaluate(WIDE_LLAMA, cluster="dgx-h100", global_batch=8, tp=8, pp=1, microbatch_size=1,
                               tp_overlap="off")
    assert (fused.tp_overlap, exposed.tp_overlap) == ("async", "off")
    assert fused.predicted.step_time_s < exposed.predicted.step_time_s
    assert fused.predicted.breakdown_s["tp.all_gather"] < exposed.predicted.breakdown_s["tp.all_gather"]
    assert Plan.from_dict(fused.to_dict()).tp_overlap == "async"
    from autopar.report.explain import explain_text

    assert "tp_overlap async" in explain_text(fused) and "tp_overlap" not in explain_text(exposed)
    assert "tp overlap    async" in fused.summary() and "tp overlap" not in exposed.summary()
    assert autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8).tp_overlap == "off"  # tp = 1
    assert autopar.evaluate(GPT, cluster="cpu", global_batch=8).tp_overlap == "off"
    with pytest.raises(PlanMismatchError, match="tp_overlap='async'; expected one of 'off'"):
        Plan.from_dict({**exposed.to_dict(), "tp_overlap": "async", "sequence_parallel": False})


def test_async_tp_without_sequence_parallelism_or_off_cuda_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="sequence_parallel=False has none"):
        autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, tp=2, pp=1, microbatch_size=1,
                         sequence_parallel=False, tp_overlap="async")
    with pytest.raises(ConfigError, match="cpu cluster"):
        autopar.evaluate(GPT, cluster="cpu", global_batch=8, tp_overlap="async")
    with pytest.raises(ConfigError, match="tp_overlap"):
        autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, tp_overlap="sync")

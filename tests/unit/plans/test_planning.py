"""Precision "fp8" through plan and evaluate (plans/planning.py): recorded choice, refusals."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.plans.plan import Plan

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64"


def test_an_fp8_plan_records_its_recipe_and_linears_and_reads_back():
    plan = autopar.evaluate(GPT, cluster="cpu", global_batch=8, precision="fp8", fp8_recipe="rowwise")
    assert plan.precision == "fp8" and plan.fp8_recipe == "rowwise"
    assert len(plan.fp8_linears) == 12 and "wte.weight" not in plan.fp8_linears
    again = Plan.from_dict(plan.to_dict())
    assert again.fp8_linears == plan.fp8_linears and again.fp8_recipe == "rowwise"
    assert autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8).fp8_linears == ()


BIG = "gpt:layers=1,hidden=16384,heads=128,seq=4096,vocab=1024"


def test_on_fp8_tensor_cores_the_planner_keeps_float8_where_it_is_faster():
    """torchao's eager casts cost memory passes that only large matmuls repay: the 16384 x 65536
    MLP linears at 16,384 tokens run in float8, a 64-wide model's linears stay in bf16."""
    big = autopar.evaluate(BIG, cluster="dgx-h100:gpus_per_node=1", global_batch=4, microbatch_size=4,
                           precision="fp8")
    assert big.fp8_linears == ("layers.0.mlp.fc_in.weight", "layers.0.mlp.fc_out.weight")
    bf16 = autopar.evaluate(BIG, cluster="dgx-h100:gpus_per_node=1", global_batch=4, microbatch_size=4)
    assert big.predicted.step_time_s < bf16.predicted.step_time_s
    tiny = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8")
    assert tiny.fp8_linears == () and any("0 of 12 eligible linears" in note for note in tiny.notes)
    # A filter is the user's choice: kept as given.
    forced = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8",
                              fp8_filter=lambda fqn, shape: True)
    assert len(forced.fp8_linears) == 12


def test_a_filter_chooses_the_linears():
    plan = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8",
                            fp8_filter=lambda fqn, shape: fqn.endswith("fc_in"))  # kept as given
    assert plan.fp8_linears == ("layers.0.mlp.fc_in.weight", "layers.1.mlp.fc_in.weight")


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

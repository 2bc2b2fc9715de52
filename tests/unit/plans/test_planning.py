"""Precision "fp8" through plan and evaluate (plans/planning.py): recorded choice, refusals."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.plans.plan import Plan

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64"


def test_an_fp8_plan_records_its_recipe_and_linears_and_reads_back():
    plan = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8", fp8_recipe="rowwise")
    assert plan.precision == "fp8" and plan.fp8_recipe == "rowwise"
    assert len(plan.fp8_linears) == 12 and "wte.weight" not in plan.fp8_linears
    again = Plan.from_dict(plan.to_dict())
    assert again.fp8_linears == plan.fp8_linears and again.fp8_recipe == "rowwise"
    assert autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8).fp8_linears == ()


def test_a_filter_chooses_the_linears():
    plan = autopar.evaluate(GPT, cluster="dgx-h100", global_batch=8, precision="fp8",
                            fp8_filter=lambda fqn, shape: fqn.endswith("fc_in"))
    assert plan.fp8_linears == ("layers.0.mlp.fc_in.weight", "layers.1.mlp.fc_in.weight")


@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "p3-16xlarge"])
def test_gpus_without_fp8_tensor_cores_are_refused_with_the_reason(cluster):
    with pytest.raises(ConfigError, match="needs FP8 tensor cores"):
        autopar.evaluate(GPT, cluster=cluster, global_batch=8, precision="fp8")


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

"""Bad arguments to the Python API: each raises an AutoparError subclass naming the argument.

Checked before any capture where the check needs no graph, so a wrong type fails in
milliseconds and never as a TypeError from deep inside the planner.
"""

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.export import capture
from autopar.api import parallelize  # noqa: F401 - imported before any alarm (see harness)
from bad_input_harness import FOUR_GPUS, TINY, api_error
from autopar.errors import CaptureError, ClusterSpecError, ConfigError, ModelSpecError, PlanMismatchError


def plan_call(**changes):
    arguments = dict(cluster=FOUR_GPUS, global_batch=8)
    arguments.update(changes)
    model = arguments.pop("model", TINY)
    return lambda: autopar.plan(model, **arguments)


def evaluate_call(**changes):
    arguments = dict(cluster=FOUR_GPUS, global_batch=8)
    arguments.update(changes)
    return lambda: autopar.evaluate(TINY, **arguments)


PLAN_CASES = [
    (dict(global_batch="8"), ["global_batch", "int", "str"]),
    (dict(global_batch=None), ["global_batch", "int", "None"]),
    (dict(global_batch=8.0), ["global_batch", "int", "float"]),
    (dict(global_batch=True), ["global_batch", "int", "bool"]),
    (dict(global_batch=0), ["global_batch", ">= 1"]),
    (dict(global_batch=-4), ["global_batch", ">= 1"]),
    (dict(global_batch=10**30), ["global_batch", "at most"]),
    (dict(constraints={"tp": "2"}), ["constraints", "tp", "int"]),
    (dict(constraints={"tp": 0}), ["constraints", "tp", ">= 1"]),
    (dict(constraints={"dp": -1}), ["constraints", "dp", ">= 1"]),
    (dict(constraints={"tp": 2.5}), ["constraints", "tp", "int"]),
    (dict(constraints={"pp": None, "tp": True}), ["constraints", "tp", "int"]),
    (dict(constraints={"microbatch_size": 0}), ["microbatch_size", ">= 1"]),
    (dict(constraints={"virtual_stages": 0}), ["virtual_stages", ">= 1"]),
    (dict(constraints={"layers_per_virtual_stage": 0}), ["layers_per_virtual_stage", ">= 1"]),
    (dict(constraints={"schedule": "zigzag"}), ["schedule", "zigzag"]),
    (dict(constraints={"schedule": 1}), ["schedule"]),
    (dict(constraints={"recompute": "partial"}), ["recompute", "partial"]),
    (dict(constraints={"recompute": "blocks:x"}), ["recompute", "'blocks:x'", "N >= 1"]),
    (dict(constraints={"zero_stage": 5}), ["zero_stage"]),
    (dict(constraints={"zero_stage": "1"}), ["zero_stage"]),
    (dict(constraints={"sequence_parallel": "off"}), ["sequence_parallel", "True or False", "str"]),
    (dict(constraints={"sequence_parallel": False, "recompute": "gathers"}), ["gathers", "sequence_parallel=False",
                                                                            "use recompute 'none'"]),
    (dict(constraints={"foo": 1}), ["unknown constraint", "foo"]),
    (dict(constraints={1: 2}), ["constraint"]),
    (dict(constraints=[("tp", 2)]), ["constraints", "dict"]),
    (dict(constraints="tp=2"), ["constraints", "dict"]),
    (dict(constraints={"tp": 16}), ["tp=16", "4 devices"]),
    (dict(constraints={"tp": 16}, cluster="dgx-h100:nodes=2"), ["tp=16", "8 gpus", "inside a node"]),
    (dict(constraints={"tp": 4, "dp": 4}), ["dp", "tp", "4 devices"]),
    (dict(precision="fp16"), ["precision", "fp16"]),
    (dict(precision=None), ["precision"]),
    (dict(cluster=42), ["cluster", "int"]),
    (dict(cluster=None), ["cluster", "None"]),
    (dict(cluster=["dgx-h100"]), ["cluster", "list"]),
    (dict(cluster="dgx\x00h100"), ["cluster", "NUL"]),
    (dict(cluster="q" * 100_000), ["unknown preset"]),
    (dict(model=42), ["model", "int"]),
    (dict(model=None), ["model", "None"]),
    (dict(model=nn.Linear), ["model", "class"]),
    (dict(model=nn.Linear(8, 4)), ["example_inputs"]),
    (dict(model=nn.Linear(8, 4), example_inputs="hello"), ["example_inputs", "str"]),
    (dict(model=nn.Linear(8, 4), example_inputs=42), ["example_inputs", "int"]),
    (dict(model=nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), loss_fn="mse"), ["loss_fn", "str"]),
    (dict(model=nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), example_targets="y"),
     ["example_targets", "str"]),
    (dict(model=nn.Linear(8, 4), example_inputs=(torch.randn(2, 5),)), ["shape"]),
    (dict(options="fast"), ["options", "SearchOptions"]),
    (dict(verbose="yes"), ["verbose", "bool"]),
    (dict(model="gpt:layers=100000"), ["layers", "at most"]),
    (dict(model="x" * 100_000), ["unknown model"]),
]


@pytest.mark.parametrize("changes, fragments", PLAN_CASES, ids=[f"plan{i}" for i in range(len(PLAN_CASES))])
def test_bad_plan_argument(changes, fragments):
    error = api_error(plan_call(**changes), *fragments)
    assert "x" * 1000 not in str(error) and "q" * 1000 not in str(error)


EVALUATE_CASES = [
    (dict(tp="2"), ["tp", "int", "str"]),
    (dict(pp=None), ["pp", "int"]),
    (dict(tp=0), ["tp", ">= 1"]),
    (dict(pp=-1), ["pp", ">= 1"]),
    (dict(dp=0), ["dp", ">= 1"]),
    (dict(dp="2"), ["dp", "int"]),
    (dict(microbatch_size=0), ["microbatch_size", ">= 1"]),
    (dict(microbatch_size=1.5), ["microbatch_size", "int"]),
    (dict(schedule="zigzag"), ["schedule", "zigzag"]),
    (dict(recompute="yes"), ["recompute", "yes"]),
    (dict(recompute="blocks:0"), ["recompute", "'blocks:0'", "N >= 1"]),
    (dict(recompute="blocks:7"), ["blocks:7", "holds 2 block(s)", "fewer than 7"]),
    (dict(zero_stage="1"), ["zero_stage"]),
    (dict(zero_stage=4), ["zero_stage"]),
    (dict(virtual_stages=0, schedule="interleaved", pp=2), ["virtual_stages", ">= 1"]),
    (dict(tp=16, cluster="dgx-h100:nodes=2"), ["tp=16", "8 gpus"]),
    (dict(tp=3), ["tp=3", "divide"]),
    (dict(global_batch="8"), ["global_batch", "int"]),
    (dict(precision="int8"), ["precision"]),
    (dict(sequence_parallel=0), ["sequence_parallel", "True or False"]),
    (dict(sequence_parallel=False, recompute="gathers"), ["gathers", "sequence_parallel=False"]),
]


@pytest.mark.parametrize("changes, fragments", EVALUATE_CASES, ids=[f"evaluate{i}" for i in range(len(EVALUATE_CASES))])
def test_bad_evaluate_argument(changes, fragments):
    api_error(evaluate_call(**changes), *fragments)


@pytest.mark.parametrize("spec, error_type, fragments", [
    ("dgx-h100:nodes=99999999999999999999", ClusterSpecError, ["nodes", "at most"]),
    ("dgx-h100:nodes=2,nodes=2", ClusterSpecError, ["twice"]),
    ("n" * 10_000 + ".toml", ClusterSpecError, ["too long"]),
    ("dgx-h100:gpus_per_node=9", ClusterSpecError, ["gpus_per_node=9"]),
    (b"dgx-h100", ClusterSpecError, ["bytes"]),
])
def test_bad_cluster_object(spec, error_type, fragments):
    api_error(lambda: autopar.Cluster.from_spec(spec), *fragments, error_type=error_type)


@pytest.mark.parametrize("call, error_type, fragments", [
    (lambda: autopar.capture_for_planning("gpt:layers=100000"), ModelSpecError, ["layers", "at most"]),
    (lambda: autopar.capture_for_planning(42), ConfigError, ["model", "int"]),
    (lambda: autopar.capture_for_planning(nn.Linear(8, 4), "hello"), ConfigError, ["example_inputs"]),
    (lambda: autopar.capture_for_planning(nn.Linear(8, 4), (torch.randn(2, 8),), precision="fp16"),
     ConfigError, ["precision"]),
    (lambda: capture(nn.Linear(8, 4), (torch.randn(2, 5),)), CaptureError, ["shape", "rejects"]),
])
def test_bad_capture_argument(call, error_type, fragments):
    api_error(call, *fragments, error_type=error_type)


def test_build_model_batch_size_bounds():
    from autopar.models import build_model

    api_error(lambda: build_model("gpt", batch_size=0), "batch_size", error_type=ModelSpecError)
    api_error(lambda: build_model("gpt", batch_size=10**12), "batch_size", "at most", error_type=ModelSpecError)


# --- plans handed to the API, checked before any process group is joined ------------------------

@pytest.fixture(scope="module")
def good_plan():
    return autopar.plan(TINY, cluster=FOUR_GPUS, global_batch=8, constraints={"tp": 2, "pp": 2})


@pytest.mark.parametrize("plan_value, fragments", [
    (42, ["plan", "int"]),
    ({"mesh": {}}, ["plan", "dict"]),
    (["plan.json"], ["plan", "list"]),
])
def test_parallelize_bad_plan_argument(plan_value, fragments):
    api_error(lambda: autopar.parallelize(nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), plan=plan_value),
              *fragments)


def test_parallelize_plan_with_negative_mesh(good_plan):
    from dataclasses import replace

    bad = replace(good_plan, mesh={"pp": 2, "dp": -1, "tp": 2})
    api_error(lambda: autopar.parallelize(nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), plan=bad),
              "mesh", "dp", error_type=PlanMismatchError)


def test_parallelize_plan_lacking_an_axis(good_plan):
    from dataclasses import replace

    bad = replace(good_plan, mesh={"pp": 2, "tp": 2})
    api_error(lambda: autopar.parallelize(nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), plan=bad),
              "mesh", "dp", error_type=PlanMismatchError)


@pytest.mark.parametrize("model, inputs, fragments", [
    ("gpt", (torch.randn(2, 8),), ["model", "nn.Module", "str"]),
    (42, (torch.randn(2, 8),), ["model", "int"]),
    (nn.Linear(8, 4), "hello", ["example_inputs", "str"]),
    (nn.Linear(8, 4), None, ["example_inputs"]),
])
def test_parallelize_bad_model_or_inputs(model, inputs, fragments):
    api_error(lambda: autopar.parallelize(model, example_inputs=inputs), *fragments)


def test_parallelize_bad_global_batch():
    api_error(lambda: autopar.parallelize(nn.Linear(8, 4), example_inputs=(torch.randn(2, 8),), global_batch="2"),
              "global_batch", "int")


def test_plan_from_dict_not_a_dict():
    api_error(lambda: autopar.Plan.from_dict([1, 2]), "json object", error_type=PlanMismatchError)

"""Plan data: JSON round trip, validation of plan files, matching a plan to a model."""

import dataclasses
import json

import pytest

import autopar
from autopar.errors import PlanMismatchError
from autopar.plans.plan import SCHEMA_VERSION, Plan

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return autopar.plan(MODEL, cluster="dgx-a100-80g:gpus_per_node=4", global_batch=8)


def test_json_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.summary() == plan.summary()


def test_json_has_the_documented_keys(plan):
    data = json.loads(plan.to_json())
    assert set(data["mesh"]) == {"pp", "dp", "cp", "tp"}
    assert data["mesh"]["pp"] * data["mesh"]["dp"] * data["mesh"]["cp"] * data["mesh"]["tp"] == 4
    for key in ("microbatch_size", "num_microbatches", "schedule", "recompute", "zero_stage", "stages"):
        assert key in data
    assert data["microbatch_size"] * data["num_microbatches"] * data["mesh"]["dp"] == 8
    predicted = data["predicted"]
    assert predicted["step_time_s"] > 0
    assert abs(sum(predicted["breakdown_s"].values()) - predicted["step_time_s"]) < 1e-9 * predicted["step_time_s"] + 1e-12
    assert {"parameters", "gradients", "optimizer", "activations"} <= set(predicted["memory_bytes"])
    assert predicted["peak_memory_bytes"] == pytest.approx(sum(predicted["memory_bytes"].values()))
    assert all("layers" in stage for stage in data["stages"])
    assert data["schema_version"] == SCHEMA_VERSION


def test_summary_explains_the_plan(plan):
    text = plan.summary()
    for fragment in ("mesh", "predicted", "step time breakdown", "memory per device", "alternatives considered"):
        assert fragment in text


def test_plan_matches_only_its_model(plan):
    plan.check_matches(model_fingerprint=plan.model_fingerprint, num_devices=4)
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        plan.check_matches(model_fingerprint="0" * 16, num_devices=4)
    with pytest.raises(PlanMismatchError, match="4 devices"):
        plan.check_matches(model_fingerprint=plan.model_fingerprint, num_devices=8)


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ('{"schema_version": 99}', "schema_version 99"),
    ('{"schema_version": %d}' % SCHEMA_VERSION, "missing or has a malformed field"),
    ("[1, 2]", "not a JSON object"),
])
def test_bad_plan_files(tmp_path, content, fragment):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanMismatchError, match=fragment):
        Plan.load(path)


def test_missing_plan_file(tmp_path):
    with pytest.raises(PlanMismatchError, match="cannot read plan"):
        Plan.load(tmp_path / "nope.json")


def test_stage_recompute_falls_back_to_the_plans_and_survives_json(plan):
    stages = (dataclasses.replace(plan.stages[0], recompute="none"),) + plan.stages[1:]
    edited = dataclasses.replace(plan, recompute="full", stages=stages)
    assert edited.stage_recompute(0) == "none"
    assert edited.stage_recompute(len(stages)) == "full"
    loaded = Plan.from_dict(json.loads(edited.to_json()))
    assert loaded.stage_recompute(0) == "none"


@pytest.mark.parametrize("field, value", [("recompute", "sometimes"), ("schedule", "zigzag"), ("zero_stage", 4),
                                          ("calibration", "maybe")])
def test_plan_file_with_an_unknown_choice(plan, field, value):
    data = json.loads(plan.to_json())
    data[field] = value
    with pytest.raises(PlanMismatchError, match=f"{field}={value!r}"):
        Plan.from_dict(data, source="edited.json")


def test_a_plan_says_what_its_step_time_was_priced_from_and_older_files_load(plan):
    """A preset cluster without a profile is priced from its datasheet; a plan file written before
    the field loads with "" (unknown)."""
    assert plan.calibration == "datasheet"
    data = json.loads(plan.to_json())
    assert data["calibration"] == "datasheet"
    del data["calibration"]
    assert Plan.from_dict(data, source="old.json").calibration == ""

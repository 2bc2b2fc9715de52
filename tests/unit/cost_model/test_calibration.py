"""The calibration section of a profile: typed data, JSON round trip, which one applies, refusals."""

import ast
import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import ProfileError
from cost_model.calibration import (CALIBRATION_VERSION, TERMS, Calibration, CalibrationPoint, core_sharing_factor,
                                    select_calibration)
from cost_model.errors import CostModelInputError
from cost_model.profile import SCHEMA_VERSION, HardwareProfile, MatmulPoint, load_profile, profile_from_dict

TINY_GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=96,dropout=0.0"


@pytest.fixture(scope="module")
def graph():
    return autopar.capture_for_planning(TINY_GPT, precision="fp32")


def make_calibration(**changes) -> Calibration:
    values = dict(version=CALIBRATION_VERSION, model=TINY_GPT, num_processes=4, num_cores=2, host=socket.gethostname(),
                  device_name="CPU (2 cores)", torch_version=torch.__version__,
                  coefficients={term: (1.2 if term in ("compute.in_step", "comm.pattern") else 1e-4) for term in TERMS},
                  expected_error=0.08, worst_error=0.2,
                  points=(CalibrationPoint(config="dp=4", predicted_s=0.1, measured_s=0.2, features={"comm.calls": 3.0},
                                           fitted_s=0.19, held_out_s=0.21),))
    values.update(changes)
    return Calibration(**values)


def make_profile(calibrations=()) -> HardwareProfile:
    return HardwareProfile(schema_version=SCHEMA_VERSION, device_kind="cpu", device_name="CPU (2 cores)", num_processes=4,
                           memory_bytes=8e9, memory_bandwidth_bytes_per_s=1e10, kernel_overhead_s=3e-6,
                           matmul=(MatmulPoint(dtype="fp32", flops=1e9, achieved_flops_per_s=5e10),),
                           host=socket.gethostname(), calibrations=tuple(calibrations))


def test_a_calibrated_profile_round_trips(tmp_path):
    profile = make_profile([make_calibration(), make_calibration(num_processes=2)])
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = load_profile(path)
    assert loaded == profile
    assert loaded.calibrations[0].coefficient("comm.calls") == pytest.approx(1e-4)


def test_version_1_profiles_without_calibration_still_load():
    data = json.loads(make_profile().to_json())
    data["schema_version"] = 1
    del data["calibrations"]
    assert profile_from_dict(data).calibrations == ()


def test_a_calibration_of_an_earlier_autopar_is_left_out_and_not_written_back(tmp_path):
    """Its terms had other units (framework.dtensor_dispatch per captured op in version 1): it
    cannot price, the kernels still can, and calibrating again replaces it."""
    data = json.loads(make_profile([make_calibration(), make_calibration(num_processes=2)]).to_json())
    data["calibrations"][0]["version"] = CALIBRATION_VERSION - 1
    loaded = profile_from_dict(data)
    assert [c.num_processes for c in loaded.calibrations] == [2] and loaded.stale_calibrations == 1
    loaded.save(tmp_path / "p.json")
    assert "stale_calibrations" not in (tmp_path / "p.json").read_text()
    assert load_profile(tmp_path / "p.json").stale_calibrations == 0


@pytest.mark.parametrize("change, fragment", [
    ({"version": 99}, "version 99"),
    ({"version": "1"}, "version '1'"),
    ({"coefficients": {"made.up": 1.0}}, "unknown term"),
    ({"coefficients": {"comm.calls": -1.0}}, "comm.calls must be a finite number >= 0"),
    ({"num_cores": 0}, "num_cores must be a positive integer"),
])
def test_malformed_calibrations_are_refused(change, fragment):
    data = json.loads(make_profile([make_calibration()]).to_json())
    data["calibrations"][0].update(change)
    with pytest.raises(CostModelInputError, match=fragment):
        profile_from_dict(data)


def test_the_calibration_for_the_process_count_is_chosen():
    calibrations = (make_calibration(num_processes=2), make_calibration(num_processes=4))
    args = dict(device_name="CPU (2 cores)", host=socket.gethostname(), torch_version=torch.__version__)
    assert select_calibration(calibrations, processes_per_node=4, **args).num_processes == 4
    assert select_calibration(calibrations, processes_per_node=2, **args).num_processes == 2
    assert select_calibration(calibrations, processes_per_node=8, **args).num_processes == 4
    assert select_calibration((), processes_per_node=2, **args) is None


def test_a_calibration_of_another_machine_or_torch_is_refused():
    args = dict(processes_per_node=4, device_name="CPU (2 cores)", torch_version=torch.__version__)
    with pytest.raises(CostModelInputError, match="measured on other-host"):
        select_calibration((make_calibration(host="other-host"),), host=socket.gethostname(), **args)
    with pytest.raises(CostModelInputError, match="torch 1.0"):
        select_calibration((make_calibration(torch_version="1.0.0"),), host=socket.gethostname(),
                           **{**args, "torch_version": torch.__version__})


def test_planning_on_another_host_refuses_the_calibration(graph, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    make_profile([make_calibration()]).save(path)
    monkeypatch.setattr(socket, "gethostname", lambda: "some-other-machine")
    with pytest.raises(ProfileError, match="calibrat"):
        autopar.plan(graph, cluster=f"cpu:procs=4,profile={path}", global_batch=8, precision="fp32")


def test_a_plan_on_a_profile_whose_calibration_was_left_out_says_why(graph, tmp_path):
    data = json.loads(make_profile([make_calibration()]).to_json())
    data["calibrations"][0]["version"] = CALIBRATION_VERSION - 1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    plan = autopar.plan(graph, cluster=f"cpu:procs=4,profile={path}", global_batch=8, precision="fp32")
    assert plan.calibration == "uncalibrated"
    assert any("made by an earlier autopar" in note for note in plan.notes)


def test_core_sharing():
    assert core_sharing_factor(4, 2) == 2.0
    assert core_sharing_factor(2, 2) == 1.0
    assert core_sharing_factor(1, 8) == 1.0


def test_cost_model_imports_no_autopar():
    for path in Path("cost_model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("autopar"), path
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("autopar") for alias in node.names), path


def test_a_calibrated_plan_names_each_term_and_its_error_bar(graph, tmp_path):
    path, raw = tmp_path / "p.json", tmp_path / "raw.json"
    make_profile([make_calibration()]).save(path)
    make_profile().save(raw)
    plans = {name: autopar.plan(graph, cluster=f"cpu:procs=4,profile={file}", global_batch=8, precision="fp32",
                                constraints={"tp": 2, "pp": 2, "microbatch_size": 2, "recompute": "none", "schedule": "1f1b"})
             for name, file in (("cal", path), ("raw", raw))}
    plan, uncalibrated = plans["cal"], plans["raw"]
    for term in ("framework.eager_ops", "comm.calls", "pp.schedule", "cpu.core_sharing", "optimizer.per_tensor"):
        assert plan.predicted.breakdown_s[term] > 0, term
    # DTensor dispatch: only ops the runtime does not run on local tensors (solver/dtensor_ops.py)
    assert plan.predicted.breakdown_s.get("framework.dtensor_dispatch", 0.0) >= 0
    assert plan.predicted.step_time_s > uncalibrated.predicted.step_time_s
    assert plan.predicted.step_time_s == pytest.approx(sum(plan.predicted.breakdown_s.values()), rel=1e-9)
    assert plan.predicted.expected_error == pytest.approx(0.08)
    summary = plan.summary()
    assert "expected error +-8%" in summary and "framework.eager_ops" in summary
    assert uncalibrated.predicted.expected_error == 0.0
    assert not any(term in uncalibrated.predicted.breakdown_s for term in TERMS)


def test_terms_follow_the_configuration(graph, tmp_path):
    path = tmp_path / "p.json"
    make_profile([make_calibration(num_cores=4)]).save(path)
    plan = autopar.plan(graph, cluster=f"cpu:procs=4,profile={path}", global_batch=8, precision="fp32",
                        constraints={"dp": 4, "zero_stage": 3, "microbatch_size": 2, "recompute": "none"})
    breakdown = plan.predicted.breakdown_s
    assert breakdown["dp.hooks"] > 0
    for term in ("framework.dtensor_dispatch", "pp.schedule", "cpu.core_sharing"):
        assert breakdown.get(term, 0.0) == 0.0, term  # no tp, no pipeline, as many cores as processes

"""The `autopar` command: output contract and exit codes (a thin layer over the API)."""

import json

import pytest

from autopar.cli import main

TINY = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_json_contract(capsys):
    code, out, _ = run(capsys, "plan", TINY, "--cluster", "dgx-a100-80g:gpus_per_node=4", "--global-batch", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"dp", "tp", "pp"} <= set(data["mesh"])
    for key in ("microbatch_size", "num_microbatches", "schedule", "recompute", "zero_stage", "stages"):
        assert key in data
    for key in ("step_time_s", "breakdown_s", "peak_memory_bytes", "memory_bytes"):
        assert key in data["predicted"]


def test_plan_respects_constraints_and_saves(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", TINY, "--cluster", "dgx-a100-80g:gpus_per_node=4", "--global-batch", "8",
                       "--tp", "2", "--pp", "2", "--out", str(out_file))
    assert code == 0
    assert "tp=2" in out and "pp=2" in out
    code, shown, _ = run(capsys, "show", str(out_file))
    assert code == 0 and "pp=2" in shown


@pytest.mark.parametrize("command", [["evaluate", "--tp", "1", "--microbatch-size", "1"], ["plan"]])
def test_evaluate_and_plan_cut_stages_as_the_pipeline_split_says(capsys, command):
    code, out, _ = run(capsys, command[0], TINY, "--cluster", "dgx-a100-80g:gpus_per_node=4", "--global-batch", "8",
                       "--pp", "2", *command[1:], "--pipeline-split", "first=0", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["pipeline_split"] == "first=0"
    assert [stage["segments"] for stage in data["stages"]] == [["prologue"], ["layers.0", "layers.1", "epilogue"]]


def test_evaluate_prices_a_fixed_configuration(capsys):
    code, out, _ = run(capsys, "evaluate", TINY, "--cluster", "dgx-a100-80g:gpus_per_node=4", "--global-batch", "8",
                       "--tp", "2", "--pp", "2", "--microbatch-size", "2", "--recompute", "full", "--zero", "1",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["mesh"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 2}
    assert (data["microbatch_size"], data["num_microbatches"], data["recompute"], data["zero_stage"]) == (2, 4, "full", 1)


@pytest.mark.parametrize("command, fixed", [
    ("plan", ()), ("evaluate", ("--tp", "1", "--pp", "1", "--microbatch-size", "1"))])
def test_fp8_flags_plan_float8_linears(capsys, command, fixed):
    code, out, _ = run(capsys, command, TINY, "--cluster", "dgx-h100:gpus_per_node=4", "--global-batch", "8",
                       *fixed, "--precision", "fp8", "--fp8-recipe", "rowwise", "--json")
    assert code == 0
    data = json.loads(out)
    # A 64-wide model on H100: the planner keeps every linear in bf16 (even compiled casts cost more).
    assert (data["precision"], data["fp8_recipe"], data["fp8_linears"]) == ("fp8", "rowwise", [])
    assert data["fp8_casts"] == "compiled"  # the GPU default
    code, out, _ = run(capsys, command, TINY, "--cluster", "cpu:procs=2", "--global-batch", "8", *fixed,
                       "--precision", "fp8")
    assert code == 0 and "12 linears in float8 (torchao, tensorwise scaling), casts eager" in out
    code, out, _ = run(capsys, command, TINY, "--cluster", "cpu:procs=2", "--global-batch", "8", *fixed,
                       "--precision", "fp8", "--fp8-casts", "compiled", "--json")
    assert code == 0 and json.loads(out)["fp8_casts"] == "compiled"


@pytest.mark.parametrize("argv, fragment", [
    (["plan", TINY, "--cluster", "dgx-a100-8g", "--global-batch", "8"], "did you mean 'dgx-a100-80g'"),
    (["plan", "gtp:layers=2", "--cluster", "dgx-h100", "--global-batch", "8"], "did you mean 'gpt'"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "3"], "tp=3"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "6", "--dp", "4"], "global batch 6"),
    (["evaluate", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "2", "--pp", "2",
      "--microbatch-size", "3"], "not divisible"),
    (["show", "no-such-plan.json"], "cannot read plan"),
    (["plan", TINY, "--cluster", "dgx-a100-80g", "--global-batch", "8", "--precision", "fp8"],
     "needs FP8 tensor cores"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--fp8-casts", "eager"],
     "add --precision fp8 or drop --fp8-casts"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--fp8-recipe", "tensorwise"],
     "add --precision fp8 or drop --fp8-recipe"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--etp", "3"],
     "etp=3 runs the experts on tp=3 ranks"),
    (["evaluate", TINY, "--cluster", "p3-16xlarge", "--global-batch", "8", "--tp", "1", "--pp", "1",
      "--microbatch-size", "1", "--precision", "fp8"], "needs FP8 tensor cores"),
    (["evaluate", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "2", "--pp", "1",
      "--microbatch-size", "1", "--sequence-parallel", "off", "--tp-overlap", "async"], "--sequence-parallel off has none"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--sequence-parallel", "off", "--tp-overlap",
      "async"], "drop --sequence-parallel off or use --tp-overlap off"),
    (["plan", TINY, "--cluster", "cpu:procs=2", "--global-batch", "8", "--tp-overlap", "async"], "cpu cluster"),
    (["verify", TINY, "--nproc", "2", "--kinds", "dp,dpxtp"], "give --nproc 4"),
    (["verify", TINY, "--kinds", "dp,zz"], "unknown plan kind 'zz'"),
    (["verify", "no-such-model", "--nproc", "2"], "unknown model"),
    (["evaluate", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "2", "--pp", "1",
      "--microbatch-size", "1", "--etp", "3"],
     "etp=3 must divide tp=2"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "2", "--etp", "1"],
     "etp=1: with tp > 1 it folds the MoE layers"),
    (["evaluate", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "1", "--pp", "2",
      "--microbatch-size", "1", "--pipeline-split", "even"], "pipeline_split must be 'balanced'"),
    (["evaluate", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--tp", "1", "--pp", "2",
      "--microbatch-size", "1", "--pipeline-split", "uniform:head"], "2 repeated blocks + the head = 3 does not divide by 2"),
    (["plan", TINY, "--cluster", "dgx-h100", "--global-batch", "8", "--pp", "2", "--pipeline-split", "first=3"],
     "puts 3 repeated blocks on the end chunks, more than the model's 2"),
])
def test_bad_input_exits_2_with_one_message(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("autopar: error:")
    assert fragment in err
    assert "Traceback" not in err


def test_model_that_cannot_fit_names_the_memory_it_needs(capsys):
    code, _, err = run(capsys, "plan", "gpt3-175b:layers=8", "--cluster", "dgx-a100-40g:gpus_per_node=1",
                       "--global-batch", "8")
    assert code == 2
    assert "does not fit" in err and "GiB per device" in err


def test_models_and_graph(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "gpt3-175b" in out and "llama3-8b" in out
    code, out, _ = run(capsys, "graph", TINY)
    assert code == 0 and "block 0" in out and "x2 identical" in out


def test_profile_writes_a_profile_the_cluster_spec_loads(capsys, tmp_path, monkeypatch):
    # What is measured, and how well, is test_profiler's business; here the command's plumbing is:
    # the options it asks for, the file it writes, and the cluster spec reading that file. So the
    # quick sweep is cut to small fp32 matmuls: bf16 at 1024 runs ~4 s a call on a CPU without
    # native bf16, and under load the bf16 probe (2 threads, timed at 256) can keep it.
    import dataclasses

    import cost_model.profiler as profiler

    asked = []
    measure = profiler.run_profile

    def small_sweep(options, **kwargs):
        asked.append(options)
        return measure(dataclasses.replace(options, matmul_sizes=(64, 128, 256), matmul_dtypes=("fp32",)), **kwargs)

    monkeypatch.setattr(profiler, "run_profile", small_sweep)
    out_file = tmp_path / "profile.json"
    code, out, _ = run(capsys, "profile", "--device", "cpu", "--nproc", "1", "--quick", "--out", str(out_file))
    assert code == 0 and "matmul" in out
    assert "not calibrated" in out  # one process: no parallel configurations to run whole steps of
    assert [(o.device, o.num_processes, o.quick) for o in asked] == [("cpu", 1, True)]
    code, out, _ = run(capsys, "plan", TINY, "--cluster", f"cpu:procs=1,profile={out_file}", "--global-batch", "2")
    assert code == 0 and "predicted" in out
    assert "UNCALIBRATED profile" in out and "autopar profile --nproc N" in out
    code, out, _ = run(capsys, "plan", TINY, "--cluster", f"cpu:procs=1,profile={out_file}", "--global-batch", "2",
                       "--json")
    assert code == 0 and json.loads(out)["calibration"] == "uncalibrated"


def test_profile_calibrates_on_a_small_built_in_model_unless_told_not_to(capsys, monkeypatch, tmp_path):
    """`autopar profile --nproc N` (N >= 2, CPU) measures, then calibrates whole steps of the
    default model into the same file; --no-calibrate measures only;
    --calibrate MODEL picks it, repeated for several."""
    import autopar.tune.calibrate as calibrate
    import autopar.tune.profile as profile
    from autopar.tune.defaults import DEFAULT_CALIBRATION_MODELS

    measured, calibrated = [], []

    class Measured:
        device_name, device_kind, matmul, collectives = "cpu", "cpu", (), ()

    monkeypatch.setattr(profile, "profile_machine", lambda **kwargs: measured.append(kwargs) or Measured())

    class Calibration:
        num_processes = 2

    class Calibrated:
        calibrations = (Calibration(),)

    monkeypatch.setattr(calibrate, "calibrate_profile",
                        lambda model, out, **kwargs: calibrated.append((model, out, kwargs["num_processes"])) or Calibrated())
    monkeypatch.setattr(calibrate, "describe_calibration", lambda calibration: "fitted")
    out_file = str(tmp_path / "p.json")
    code, out, _ = run(capsys, "profile", "--device", "cpu", "--nproc", "2", "--quick", "--out", out_file)
    assert code == 0 and calibrated == [(list(DEFAULT_CALIBRATION_MODELS), out_file, 2)] and len(measured) == 1
    assert len(DEFAULT_CALIBRATION_MODELS) == 1 and DEFAULT_CALIBRATION_MODELS[0].startswith("gpt:layers=4")
    calibrated.clear()
    code, out, _ = run(capsys, "profile", "--device", "cpu", "--nproc", "2", "--no-calibrate", "--out", out_file)
    assert code == 0 and calibrated == [] and len(measured) == 2
    code, out, _ = run(capsys, "profile", "--nproc", "2", "--calibrate", "tiny-gpt", "--calibrate", "gpt:layers=2",
                       "--out", out_file)
    assert code == 0 and calibrated == [(["tiny-gpt", "gpt:layers=2"], out_file, 2)]
    code, _, err = run(capsys, "profile", "--nproc", "2", "--no-calibrate", "--calibrate", "tiny-gpt", "--out", out_file)
    assert code == 2 and "contradict" in err


def test_profile_refuses_impossible_requests(capsys, tmp_path):
    code, _, err = run(capsys, "profile", "--device", "cuda", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "cuda" in err.lower()
    code, _, err = run(capsys, "profile", "--device", "cpu", "--nproc", "100000", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "100000" in err

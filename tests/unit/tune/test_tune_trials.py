"""Trial selection with injected timings, the record in the plan, and its report."""

import dataclasses

import pytest
import torch

from autopar import api
from autopar.errors import ConfigError
from autopar.plans.plan import Plan
from autopar.tune import trials
from autopar.tune.trials import TrialOptions, TrialResult, record_trials, run_trials, select_winner

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


@pytest.fixture(scope="module")
def candidates() -> list[Plan]:
    return api.candidate_plans(MODEL, cluster="dgx-a100-80g:gpus_per_node=2", global_batch=8,
                                       num_candidates=3, constraints={"recompute": "none", "zero_stage": 0})


def _result(measured, predicted=1.0, **changes) -> TrialResult:
    return TrialResult(config="c", predicted_s=predicted, measured_s=measured, **changes)


def test_the_measured_fastest_wins():
    assert select_winner([_result(3.0), _result(1.0), _result(2.0)]) == 1
    assert select_winner([_result(1.0), _result(1.0)]) == 0  # a tie goes to the better predicted
    assert select_winner([_result(None, error="OOM"), _result(2.0)]) == 1
    assert select_winner([_result(2.0), _result(0.5, stopped_early=True)]) == 0
    assert select_winner([_result(None, error="x"), _result(None, error="y")]) == 0
    with pytest.raises(ConfigError):
        select_winner([])


def test_candidates_are_distinct_and_fastest_predicted_first(candidates):
    times = [plan.predicted.step_time_s for plan in candidates]
    assert len(candidates) == 3 and times == sorted(times)
    assert len({trials.describe(plan) for plan in candidates}) == 3


class _FakeModule:
    """Stands in for a ParallelModule: counts steps; its time is injected."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.steps = 0

    def parameters(self):
        return [self.weight]

    def train_step(self, inputs, targets):
        self.steps += 1
        self.weight.grad = torch.ones(2)
        return torch.zeros(())


def test_run_trials_with_injected_timings(candidates, one_process_group, monkeypatch):
    step_s = {trials.describe(candidates[0]): 0.30, trials.describe(candidates[1]): 0.10,
              trials.describe(candidates[2]): 0.50}
    built = []

    def build(model, inputs, plan, loss_fn):
        if plan is candidates[2]:
            built.append(plan)
        module = _FakeModule(plan)
        built.append(module)
        return module

    monkeypatch.setattr(trials, "_timed_step", lambda pm, optimizer, inputs, targets: step_s[trials.describe(pm.plan)])
    model = torch.nn.Linear(2, 2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    messages = []
    results = run_trials(model, (torch.zeros(8, 2),), torch.zeros(8, 2), torch.nn.functional.mse_loss, candidates,
                         options=TrialOptions(warmup_steps=1, steps=4), progress=messages.append, build=build)
    assert [r.measured_s for r in results] == [0.30, 0.10, 0.50]
    assert results[2].stopped_early and len(results[2].step_times_s) == 2  # 5x the best: gave up after 2 steps
    assert len(results[0].step_times_s) == 4
    assert select_winner(results) == 1
    assert any("trial 2/3" in message and "measured 100.0 ms" in message for message in messages)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_failing_candidate_is_recorded_and_the_others_run(candidates, one_process_group, monkeypatch):
    def build(model, inputs, plan, loss_fn):
        if plan is candidates[0]:
            raise RuntimeError("out of memory")
        return _FakeModule(plan)

    monkeypatch.setattr(trials, "_timed_step", lambda *args: 0.2)
    results = run_trials(torch.nn.Linear(2, 2), (torch.zeros(8, 2),), torch.zeros(8, 2),
                         torch.nn.functional.mse_loss, candidates[:2], options=TrialOptions(warmup_steps=0, steps=2),
                         build=build)
    assert results[0].measured_s is None and "out of memory" in results[0].error
    assert results[1].measured_s == 0.2 and select_winner(results) == 1


def test_trials_need_targets(candidates):
    with pytest.raises(ConfigError, match="example_targets"):
        run_trials(torch.nn.Linear(2, 2), (torch.zeros(8, 2),), None, None, candidates)


def test_the_plan_records_and_reports_every_candidate(candidates, tmp_path):
    results = [_result(0.3, predicted=candidates[0].predicted.step_time_s),
               _result(0.1, predicted=candidates[1].predicted.step_time_s),
               _result(None, predicted=candidates[2].predicted.step_time_s, error="RuntimeError: boom")]
    results = [dataclasses.replace(r, config=trials.describe(plan)) for r, plan in zip(results, candidates)]
    chosen = record_trials(candidates[1], results, 1)
    path = tmp_path / "plan.json"
    chosen.save(path)
    loaded = Plan.load(path)
    assert loaded.trials == chosen.trials and [row["chosen"] for row in loaded.trials] == [False, True, False]
    assert loaded.trials[1]["measured_s"] == 0.1
    assert loaded.trials[1]["error"] == pytest.approx(candidates[1].predicted.step_time_s / 0.1 - 1)
    summary = loaded.summary()
    assert "trials (measured on this job" in summary
    line = next(line for line in summary.splitlines() if "<- chosen" in line)
    assert trials.describe(candidates[1]) in line and "100.0ms" in line and "%" in line
    assert "failed" in summary and "boom" in summary


def test_trials_option_checks():
    with pytest.raises(ConfigError):
        TrialOptions(steps=0)
    with pytest.raises(ConfigError):
        TrialOptions(give_up_ratio=1.0)


def test_tune_and_calibrate_refuse_what_they_cannot_run(monkeypatch, capsys, tmp_path):
    from autopar.cli import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(["tune", MODEL, "--cluster", "cpu:procs=2", "--global-batch", "8", "--trials", "2"]) == 2
    assert "torchrun" in capsys.readouterr().err
    assert main(["profile", "--calibrate", MODEL, "--nproc", "1", "--out", str(tmp_path / "p.json")]) == 2
    assert "--nproc N with N >= 2" in capsys.readouterr().err


def test_calibration_inside_a_job_needs_an_existing_profile(monkeypatch, capsys, tmp_path):
    # Every rank of a torchrun job (its environment) refuses before it joins a process group, so
    # in-process calls stand for the job's processes; tests/dist/test_calibrate_job.py runs the
    # command as real torchrun-like processes (their exit codes included) when the profile exists.
    from autopar.cli import main

    for rank in range(2):
        for name, value in dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2).items():
            monkeypatch.setenv(name, str(value))
        assert main(["profile", "--calibrate", MODEL, "--out", str(tmp_path / "p.json")]) == 2
        assert "autopar profile --out" in capsys.readouterr().err
        assert not (tmp_path / "p.json").exists()


def test_interleaved_trials_run_in_rotating_rounds(candidates, one_process_group, monkeypatch):
    order = []

    def timed(pm, optimizer, inputs, targets):
        order.append(trials.describe(pm.plan))
        return {0: 0.3, 1: 0.1, 2: 0.2}[[trials.describe(p) for p in candidates].index(order[-1])]

    monkeypatch.setattr(trials, "_timed_step", timed)
    results = run_trials(torch.nn.Linear(2, 2), (torch.zeros(8, 2),), torch.zeros(8, 2),
                         torch.nn.functional.mse_loss, candidates,
                         options=TrialOptions(warmup_steps=1, steps=3, interleave=True),
                         build=lambda model, inputs, plan, loss_fn: _FakeModule(plan))
    names = [trials.describe(p) for p in candidates]
    assert order[:3] == names and order[3:6] == names[1:] + names[:1]  # each round starts one later
    assert [len(r.step_times_s) for r in results] == [3, 3, 3] and select_winner(results) == 1


def test_a_measured_moe_load_imbalance_is_recorded_and_said(candidates):
    plan = dataclasses.replace(candidates[0], moe_load_imbalance=1.25)
    result = dataclasses.replace(_result(0.2, predicted=plan.predicted.step_time_s), moe_load_imbalance=1.4)
    recorded = record_trials(plan, [result], 0)
    assert recorded.trials[0]["moe_load_imbalance"] == 1.4
    assert any("measured MoE load imbalance 1.4" in note and "--moe-load-imbalance 1.4" in note
               for note in recorded.notes)


def test_the_measured_imbalance_is_the_mean_over_expert_layers():
    class Measured:
        def expert_load(self):
            return {"layer0": 1.2, "layer1": 1.6}

    assert trials._measured_imbalance(Measured()) == pytest.approx(1.4)
    assert trials._measured_imbalance(object()) is None

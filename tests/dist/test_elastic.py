"""Failures of a job: a stopped rank makes its peers fail naming it, within the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port, run_workers

TIMEOUT_S = 10
"""AUTOPAR_COLLECTIVE_TIMEOUT_S of the stuck job (the default is 300 s)."""


def _start_stuck_job(**env_extra) -> list[subprocess.Popen]:
    port = free_port()
    processes = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   AUTOPAR_COLLECTIVE_TIMEOUT_S=str(TIMEOUT_S), **env_extra)
        processes.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("stuck_job.py"))], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


def _read_until(process: subprocess.Popen, prefix: str) -> list[str]:
    deadline_s = time.monotonic() + 240
    said = []
    for line in process.stdout:
        said.append(line)
        if line.startswith(prefix) or time.monotonic() > deadline_s:
            break
    assert said and said[-1].startswith(prefix), "".join(said)[-3000:]
    return said


def _survivor_fails(processes: list[subprocess.Popen], stopped_at_s: float) -> tuple[str, float]:
    survivor = processes[0]
    try:
        output, _ = survivor.communicate(timeout=TIMEOUT_S + 90)
        waited_s = time.monotonic() - stopped_at_s
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()  # only the processes this test started (SIGKILL ends a stopped one too)
            process.wait()
    assert survivor.returncode not in (0, None), output[-3000:]
    return output, waited_s


def test_a_stopped_rank_makes_its_peer_fail_naming_it():
    processes = _start_stuck_job()
    _read_until(processes[1], "step 2")  # the job trains: stop rank 1 after its second step
    processes[1].send_signal(signal.SIGSTOP)
    output, waited_s = _survivor_fails(processes, time.monotonic())
    assert "rank 1 stopped answering" in output and "collective of train_step" in output, output[-3000:]
    assert waited_s < TIMEOUT_S + 60, waited_s


@pytest.mark.parametrize("phase, where", [("clip", "gradient clipping after train_step 2"),
                                          ("save", "checkpoint save after train_step 2")])
def test_a_rank_stopped_before_clipping_or_a_save_is_named_by_its_peer(tmp_path, phase, where):
    """Rank 1 SIGSTOPs itself right before clip_grad_norm_ (or a checkpoint save) of step 2: rank 0
    waits in that phase's collective and fails naming rank 1 and where it stopped."""
    processes = _start_stuck_job(STOP_BEFORE=phase, CHECKPOINT_DIR=str(tmp_path))
    _read_until(processes[1], "stopping before")
    output, waited_s = _survivor_fails(processes, time.monotonic())
    last_place = "step 2, loss all-reduce" if phase == "clip" else "step 2, gradient clipping"
    assert f"a collective of {where} failed" in output, output[-3000:]
    assert f"rank 1 stopped answering (its last recorded place: {last_place})" in output, output[-3000:]
    assert waited_s < TIMEOUT_S + 60, waited_s
    assert not list(tmp_path.glob("step-2")), "a save that failed was published"


def test_a_lost_node_resumes_on_the_survivors_and_a_new_one_scales_back_up(tmp_path):
    """Two torchrun agents of 2 processes; one is SIGKILLed with its workers mid-training; the
    other re-plans for 2 processes and resumes from the newest complete checkpoint; a third agent
    joins and the job re-plans for 4 again and finishes. Every step's loss equals an uninterrupted
    one-process run's within 1e-5, and each step read the reference's samples
    (examples/elastic_drill.py --scale-up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "elastic_drill", Path(__file__).parents[2] / "examples" / "elastic_drill.py")
    drill = importlib.util.module_from_spec(spec)
    sys.modules["elastic_drill"] = drill  # its dataclasses look their module up by name
    spec.loader.exec_module(drill)
    args = drill.parse_args(["--steps", "10", "--save-every", "2", "--step-sleep-s", "0.5", "--timeout-s", "400",
                             "--scale-up"])
    try:
        result = drill.run_drill(args, tmp_path / "first")
    except (RuntimeError, TimeoutError) as error:
        # Under load agent b used to start after agent a's last call and join a later round, where
        # torch 2.13's shared store never publishes MASTER_ADDR: both agents timed out (the drill
        # now sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). Whether that was the only cause of the
        # flake seen in CI is not known, so the drill still runs once more on a failure, printing
        # the first one (with the agents' last lines; shown if the test fails).
        print(f"first drill failed, retried once: {error}")
        result = drill.run_drill(args, tmp_path / "second")
    assert result.exit_codes["a"] == 0, result.outputs["a"]
    assert result.exit_codes["c"] == 0, result.outputs["c"]
    assert drill._went(result.worlds, (4, 2, 4)), result.worlds
    assert max(result.loss_errors.values()) <= 1e-5, result.loss_errors
    assert not result.sample_problems, result.sample_problems


def _draws(folder: str, total_steps: int, stop_at: int | None = None,
           constraints: dict | None = None) -> dict[int, tuple[float, float]]:
    """pm.steps with dropout under dp=2 (or `constraints`), each rank's own RNG stream (seed 100 +
    rank): per step, a draw before the step and the loss."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import TensorDataset

    import autopar

    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(40, 8, generator=generator), torch.randn(40, 4, generator=generator))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    pm = autopar.parallelize(model, "cpu:procs=2", (dataset.tensors[0][:4],), loss_fn=nn.functional.mse_loss,
                             example_targets=dataset.tensors[1][:4], constraints=constraints or dict(dp=2, tp=1, pp=1),
                             checkpoint=folder, checkpoint_every=2)
    optimizer = torch.optim.SGD(pm.parameters(), lr=0.1)
    torch.manual_seed(100 + dist.get_rank())  # a resumed loop replaces this with the state its rank saved
    draws = {}
    for step, (inputs, targets) in pm.steps(total_steps, dataset, optimizer=optimizer):
        draw = torch.rand(()).item()
        draws[step] = (draw, pm.train_step((inputs,), targets).item())
        optimizer.step()
        optimizer.zero_grad()
        if step == stop_at:
            break
    return draws


def rng_worker(folder: str, constraints: dict | None = None) -> dict:
    uninterrupted = _draws(f"{folder}/a", 4, constraints=constraints)
    left = _draws(f"{folder}/b", 4, stop_at=3, constraints=constraints)  # leaves while step-2's write may be under way
    resumed = _draws(f"{folder}/b", 4, constraints=constraints)
    return dict(uninterrupted=uninterrupted, left=left, resumed=resumed)


def test_every_ranks_rng_resumes_and_a_loop_left_early_keeps_its_last_save(tmp_path):
    """Under dp=2 the ranks' RNG streams differ (dropout): a loop left at step 3 (break) still
    publishes step-2, and the job resumed from it draws on each rank what the uninterrupted job
    drew there, with the same losses."""
    results = run_workers(rng_worker, world_size=2, args=(str(tmp_path),), timeout_s=120)
    for rank, result in enumerate(results):
        assert sorted(result["resumed"]) == [3, 4], (rank, result)
        for step, (draw, loss) in result["resumed"].items():
            assert draw == result["uninterrupted"][step][0], (rank, step, result)
            assert abs(loss - result["uninterrupted"][step][1]) <= 1e-6, (rank, step, result)
    assert results[0]["uninterrupted"][3][0] != results[1]["uninterrupted"][3][0]  # the streams differ


def test_tp_ranks_seeded_apart_draw_alike_and_resume_alike(tmp_path):
    """Under tp=2 the ranks' streams are made equal at each step's start (codegen/random_ops.py):
    from step 2 on, a draw between steps is the same on both ranks, and the job resumed from its
    step-2 save (each rank its own saved state, equal ones) continues the uninterrupted losses."""
    results = run_workers(rng_worker, world_size=2, args=(str(tmp_path), dict(dp=1, tp=2, pp=1)), timeout_s=120)
    for rank, result in enumerate(results):
        assert sorted(result["resumed"]) == [3, 4], (rank, result)
        for step, (draw, loss) in result["resumed"].items():
            assert draw == result["uninterrupted"][step][0], (rank, step, result)
            assert abs(loss - result["uninterrupted"][step][1]) <= 1e-6, (rank, step, result)
    first, second = (result["uninterrupted"] for result in results)
    assert first[1][0] != second[1][0]  # seeded apart: the draws before the first step differ
    assert all(first[step][0] == second[step][0] for step in (2, 3, 4)), (first, second)

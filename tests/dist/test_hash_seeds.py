"""A torchrun job whose ranks hash strings differently (torchrun does not fix PYTHONHASHSEED)
trains a model whose forward loops over a set of strings (Gemma 3's rotary tables per layer
type): rank 0's plan is recognised by the other rank's capture (capture/canonical_order.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness import launch_like_torchrun

pytestmark = pytest.mark.dist

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_ranks_with_other_string_hashes_run_one_plan():
    pytest.importorskip("transformers")
    command = [sys.executable, str(Path(__file__).with_name("hash_seed_job.py"))]
    results = launch_like_torchrun(command, world_size=2, timeout_s=240, cwd=str(REPO_ROOT),
                                   env_per_rank=lambda rank: dict(PYTHONHASHSEED=str(rank + 1),
                                                                  AUTOPAR_CAPTURE_CACHE="0"))
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
    for rank, (_, output) in enumerate(results):
        losses, one_process = json.loads(output.split("LOSSES ")[-1].splitlines()[0])
        assert losses == pytest.approx(one_process, rel=1e-4, abs=1e-4), f"rank {rank}"

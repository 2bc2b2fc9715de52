"""Shared fixtures: reference data from ../shared/reference (tests may read it; the product may not)."""

import csv
from pathlib import Path

import pytest
import torch

REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


def reference_rows(name: str) -> list[dict[str, str]]:
    """Rows of a reference CSV, '#' comment lines skipped."""
    path = REFERENCE_DIR / name
    if not path.exists():
        pytest.skip(f"reference data {path} not present")
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a busy CPU, OpenMP spin-waits double the time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def one_process_group():
    """A one-process group for in-process codegen (what `parallelize` starts when run standalone),
    destroyed afterwards so that later tests see no group."""
    import torch.distributed as dist

    from autopar.codegen.runtime import ensure_process_group

    started = not dist.is_initialized()
    ensure_process_group()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()

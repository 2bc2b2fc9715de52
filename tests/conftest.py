"""Shared fixtures: reference data from ../shared/reference (tests may read it; the product may not)."""

import csv
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Tests assert behaviour, never wall-clock: no per-example deadline (a loaded 2-core machine
# stalls single examples for seconds; Hypothesis would call that a failure).
settings.register_profile("autopar", deadline=None)
settings.load_profile("autopar")

REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"

# tests/unit mirrors the package in folders; its shared helpers (bad_input_harness.py) are
# imported by name from any of them.
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))


def reference_rows(name: str) -> list[dict[str, str]]:
    """Rows of a reference CSV, '#' comment lines skipped."""
    path = REFERENCE_DIR / name
    if not path.exists():
        pytest.skip(f"reference data {path} not present")
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


@pytest.fixture(autouse=True, scope="session")
def capture_cache_in_tmp(tmp_path_factory):
    """No test writes the user's capture cache: the folder is a temporary one, and the cache is
    off (a test that patches capture must see it run); tests of the cache turn it on."""
    import os

    saved = {name: os.environ.get(name) for name in ("AUTOPAR_CACHE_DIR", "AUTOPAR_CAPTURE_CACHE")}
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("autopar-cache"))
    os.environ["AUTOPAR_CAPTURE_CACHE"] = "0"
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="session")
def one_search_process():
    """Searches run in one process (AUTOPAR_JOBS=1): the two xdist workers already keep both cores
    busy, so forked search workers would only compete with them; tests of the parallel search ask
    for their jobs explicitly (tests/unit/solver/test_search_parallel.py)."""
    import os

    saved = os.environ.get("AUTOPAR_JOBS")
    os.environ["AUTOPAR_JOBS"] = "1"
    yield
    if saved is None:
        os.environ.pop("AUTOPAR_JOBS", None)
    else:
        os.environ["AUTOPAR_JOBS"] = saved


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a busy CPU, OpenMP spin-waits double the time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def quick_two_process_profile():
    """(profile, progress reports) of one quick profile of this machine with 2 gloo processes,
    measured once per test process for the tests that read one (tests/unit/cost_model/test_profiler.py, and
    tests/dist/test_calibrate_job.py, which calibrates a copy saved to its own file): a
    HardwareProfile is frozen, and a quick profile costs ~15 CPU-s (two spawned processes)."""
    from cost_model.profiler import ProfileOptions, run_profile

    reports = []
    profile = run_profile(ProfileOptions(num_processes=2, quick=True),
                          progress=lambda message, fraction: reports.append((message, fraction)))
    return profile, tuple(reports)


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


DIST_TESTS_BESIDE = ("tests/dist/test_calibrate_job.py",)
"""Multi-process tests that may run beside the other dist tests (in the other worker): jobs of two
ranks that wait on nothing but themselves (400 s timeout), so the dist worker, the suite's longer
one (~890 s of ~1660 s of tests in an idle make test), sheds ~60 s."""


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n 2` (make test) every multi-process test of tests/dist runs in one worker,
    in order, one job at a time, as without xdist (their gloo jobs keep both cores busy; two at
    once would only slow each other towards their hang timeouts), and the single-process tests
    run beside them in the other worker, one by one as workers come free. Only for the default
    `--dist load`: another --dist given on the command line is left to xdist."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":
        return None

    class DistTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(DIST_TESTS_BESIDE):
                return nodeid.split("::")[0]
            return "tests/dist" if nodeid.startswith("tests/dist/") else nodeid

    return DistTestsTogether(config, log)

"""Runs a worker function in N spawned gloo processes and returns what each rank returned.

    results = run_workers(worker, world_size=4, args=(cases,))   # [rank 0's value, rank 1's, ...]

Each process gets the environment torchrun would give it (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
LOCAL_RANK), joins a gloo process group, runs `worker(*args)` and writes its return value (or
its traceback) to a file; the parent waits for all of them. A rank that raises fails the call
with that rank's traceback; a job that runs past `timeout_s` (a hang in a collective) is killed
and fails the call instead of blocking the test run. Exceptions a test expects should be caught
inside the worker and returned as data.

    outcomes = run_cases(case_fn, world_size=4, cases={"tp": case_a, "pp": case_b})

`run_cases` runs many cases in one job, one after the other in the same process group (starting
processes and importing torch is most of a small case's time). A case that raises stops its job,
since its peers may be left inside a collective; the case is recorded as failed and a new job
runs the cases after it.

The pytest fixture `case_outcome` runs a test module's selected cases, grouped by world size,
in such shared jobs (test modules import it: `from harness import case_outcome`). This folder
has no conftest.py on purpose: pytest imports every conftest.py as the module `conftest`, so a
second one would take the place of tests/conftest.py, which tests/unit imports by that name.

Workers must be importable by name in a fresh interpreter (module-level functions of a test
module). The ranks are forked by a fork server (multiprocessing's "forkserver"), a process started
once per test process that has imported torch, DTensor and autopar (`PRELOADED_MODULES`) and
nothing else: it runs no op and joins no group, so the fork is as clean as a spawn, while each
rank skips the ~8 CPU-s those imports cost (tests/dist starts 42 ranks on two cores). A rank
gets the environment its parent has when the job starts, as a spawned one would.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from autopar.tune.verify import COMPUTE_BOUND_CLUSTER

DEFAULT_TIMEOUT_S = 240.0
PRELOADED_MODULES = ["torch", "torch.distributed.tensor", "autopar.api",
                     "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch._functorch.partitioners",
                     "torch._export.serde.serialize", "networkx", "transformers", "transformers.modeling_utils",
                     "pytest"]
"""What the fork server imports before it forks any rank: what the ranks of the dist tests import
(measured: ~8 CPU-s in all, ~0.3 s of imports left per rank). A module missing here is imported
by the rank that needs it, as before."""
_GRACE_AFTER_FAILURE_S = 10.0
"""How long the other ranks may take to finish (or fail too) after one rank failed."""
_STACKS_WAIT_S = 1.0
"""Time given to a rank to write its Python stacks (where it hangs) before it is killed."""


def tiny_model_cluster(num_devices: int, *, memory_bandwidth_gbs: float | None = None) -> str:
    """A cluster file on which the planner chooses real tensor parallelism for tiny models.

    On real A100 figures a 32-wide model is all latency: sharding a matmul saves nanoseconds and
    costs a collective, so the planner (rightly) replicates every op. With the GPUs' FLOP/s
    divided by 10^4 (links unchanged) the same model is compute-bound and the planner shards its
    linears and embeddings, as it shards a large model on real GPUs. Only the planner reads the
    file (rank 0); the processes still run on this machine's CPUs.

    `memory_bandwidth_gbs` slows the memory too, so that memory-bound work (lookups, norms,
    residual adds) is worth splitting: at 8 GB/s the tiny GPT and Llama on tp = 2 get, without
    sequence parallelism, Megatron's all-reduces (at 2 GB/s sequence-sharded norms when allowed;
    at 4 GB/s and below without them, the backward's sums of gradients (autopar/capture/gradient_sums.py)
    make hidden-sharded residuals behind column-parallel projections cheaper).
    """
    suffix = f"-membw{memory_bandwidth_gbs:g}" if memory_bandwidth_gbs is not None else ""
    path = Path(tempfile.gettempdir()) / "autopar-tests" / f"tiny-model-cluster-{num_devices}{suffix}.toml"
    text = COMPUTE_BOUND_CLUSTER.format(num_devices=num_devices)
    if memory_bandwidth_gbs is not None:
        text += f"memory_bandwidth_gbs = {memory_bandwidth_gbs}\n"
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(text)
        staging.rename(path)
    return str(path)


class WorkerError(RuntimeError):
    """A rank raised, crashed or hung; the message holds every failed rank's traceback."""


class KnownBugError(Exception):
    """A test failed the way a known bug makes it fail (for `xfail(raises=KnownBugError)`)."""


def fail(message: str, known_error: str = "") -> None:
    """Fail a test with `message`: as KnownBugError when the message shows `known_error`, so that
    an xfail for a known bug does not also hide a new, different failure."""
    if known_error and known_error in message:
        raise KnownBugError(f"the known bug ({known_error!r}):\n{message}")
    raise AssertionError(message)


def _fork_server_context():
    """multiprocessing's forkserver context, its server preloading PRELOADED_MODULES; the server
    is stopped (and waited for) when this process exits, so that no server outlives its tests
    and the ranks' CPU time is counted in this process's children's, as spawned ranks' was."""
    import atexit
    from multiprocessing import forkserver

    context = mp.get_context("forkserver")
    if not _FORK_SERVER_STOP:
        context.set_forkserver_preload(PRELOADED_MODULES)  # read when the server starts (the first job)
        stop = getattr(forkserver._forkserver, "_stop", None)  # private: a Python without it leaves the server
        if stop is not None:
            atexit.register(stop)
        _FORK_SERVER_STOP.append(stop)
    return context


_FORK_SERVER_STOP: list = []
"""Set up once per process (the atexit hook stopping the fork server)."""


SHARED_DIR_VARIABLE = "AUTOPAR_DIST_SHARED_DIR"
"""Names the folder of the test process that starts the jobs, where a job leaves what later jobs
of that process may reuse (one_process.py: the captures of the models it built)."""


def _shared_folder() -> str:
    """This test process's SHARED_DIR_VARIABLE folder, named in the environment the ranks get;
    made at the first job and removed when the process exits."""
    import atexit
    import shutil

    folder = os.environ.get(SHARED_DIR_VARIABLE)
    if not folder:
        folder = tempfile.mkdtemp(prefix="autopar-dist-shared-")
        os.environ[SHARED_DIR_VARIABLE] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_workers(worker: Callable, world_size: int, args: tuple = (), *, timeout_s: float = DEFAULT_TIMEOUT_S,
                threads_per_process: int = 1, progress: Callable[[], int] | None = None) -> list[Any]:
    """`worker(*args)` on `world_size` gloo ranks; returns the per-rank results in rank order.

    The job is killed after `timeout_s`, counted from the last time `progress()` changed when given.
    A job whose rendezvous port was taken between free_port() and rank 0's listen (another
    process on the machine bound it first) runs again on another port, up to PORT_RETRIES times."""
    for attempt in range(PORT_RETRIES + 1):
        try:
            return _run_job(worker, world_size, args, timeout_s, threads_per_process, progress)
        except WorkerError as error:
            if attempt == PORT_RETRIES or _PORT_TAKEN not in str(error):
                raise
    raise AssertionError("unreachable")


PORT_RETRIES = 2
_PORT_TAKEN = "EADDRINUSE"


def _run_job(worker: Callable, world_size: int, args: tuple, timeout_s: float, threads_per_process: int,
             progress: Callable[[], int] | None) -> list[Any]:
    context = _fork_server_context()
    _shared_folder()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autopar-dist-") as folder:
        results_dir = Path(folder)
        processes = [context.Process(target=_entry, name=f"rank{rank}", daemon=True,
                                     args=(worker, args, rank, world_size, port, threads_per_process, str(results_dir),
                                           dict(os.environ)))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        _wait(processes, timeout_s, progress)
        outcomes = [_read(results_dir, f"rank{rank}") for rank in range(world_size)]
        failures = [_describe(rank, process, outcome, results_dir)
                    for rank, (process, outcome) in enumerate(zip(processes, outcomes)) if outcome[0] != "ok"]
    if failures:
        raise WorkerError(f"{len(failures)} of {world_size} ranks failed running {worker.__name__}:\n\n"
                          + "\n\n".join(failures))
    return [value for _, value in outcomes]


@dataclass
class CaseOutcome:
    """What one case returned on each rank, or why it failed."""

    values: list[Any] | None = None
    """Per rank, in rank order (None when the case failed)."""
    error: str = ""
    """The failed rank's traceback, or what the harness saw (a hang, a crash)."""

    @property
    def ok(self) -> bool:
        return self.values is not None


def run_cases(case_fn: Callable, world_size: int, cases: dict[str, Any], *, setup_timeout_s: float = 45.0,
              timeout_per_case_s: float = 45.0, threads_per_process: int = 1) -> dict[str, CaseOutcome]:
    """`case_fn(case)` on every rank for each case, in order, in as few jobs as failures allow."""
    names = list(cases)
    outcomes: dict[str, CaseOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-cases-") as folder:
        while len(outcomes) < len(names):
            pending = [(index, cases[name]) for index, name in enumerate(names) if name not in outcomes]
            failure = ""
            try:
                run_workers(_case_loop, world_size, (case_fn, pending, folder),
                            timeout_s=setup_timeout_s + timeout_per_case_s, threads_per_process=threads_per_process,
                            progress=lambda: len(list(Path(folder).glob("case*.pkl"))))
            except WorkerError as error:
                failure = str(error)
            for index, _ in pending:
                values = [_read(Path(folder), f"case{index}.rank{rank}") for rank in range(world_size)]
                if all(kind == "ok" for kind, _ in values):
                    outcomes[names[index]] = CaseOutcome(values=[value for _, value in values])
                    continue
                # The first unfinished case is the one that failed; later ones run in the next job.
                errors = [f"--- rank {rank} raised:\n{value}" for rank, (kind, value) in enumerate(values)
                          if kind == "error"]
                outcomes[names[index]] = CaseOutcome(error="\n\n".join(errors) or failure or "no result")
                break
    return {name: outcomes[name] for name in names}


def _case_loop(case_fn: Callable, pending: list[tuple[int, Any]], folder: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    for index, case in pending:
        try:
            value = case_fn(case)
            dist.barrier()  # no rank starts the next case while a peer is still in this one
        except BaseException:  # noqa: BLE001 - recorded for the parent, then the job stops
            _write(Path(folder) / f"case{index}.rank{rank}.pkl", ("error", traceback.format_exc()))
            raise
        _write(Path(folder) / f"case{index}.rank{rank}.pkl", ("ok", value))


def _write(path: Path, outcome: tuple[str, Any]) -> None:
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001
        payload = pickle.dumps(("error", f"the result could not be pickled:\n{traceback.format_exc()}"))
    path.with_suffix(".tmp").write_bytes(payload)
    path.with_suffix(".tmp").rename(path)


def _wait(processes: list, timeout_s: float, progress: Callable[[], int] | None) -> None:
    """Wait for every process; after the first failure give the others a grace period; at the
    deadline ask the survivors for their stacks, then kill them."""
    deadline = time.monotonic() + timeout_s
    seen = progress() if progress else 0
    while any(process.is_alive() for process in processes):
        if progress and progress() != seen:
            seen = progress()
            deadline = time.monotonic() + timeout_s
        if any(process.exitcode not in (None, 0) for process in processes):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    survivors = [process for process in processes if process.is_alive()]
    for process in survivors:
        try:
            os.kill(process.pid, signal.SIGUSR1)  # faulthandler in the child writes its stacks
        except ProcessLookupError:
            pass  # it ended meanwhile
    if survivors:
        time.sleep(_STACKS_WAIT_S)
    for process in processes:
        if process.is_alive():
            process.kill()  # only processes this call started
        process.join(5)


def _read(results_dir: Path, stem: str) -> tuple[str, Any]:
    path = results_dir / f"{stem}.pkl"
    if not path.exists():
        return ("missing", None)
    with path.open("rb") as file:
        return pickle.load(file)


def _describe(rank: int, process, outcome: tuple[str, Any], results_dir: Path) -> str:
    kind, value = outcome
    if kind == "error":
        return f"--- rank {rank} raised:\n{value}"
    if process.exitcode is None or process.exitcode < 0:
        stacks_path = results_dir / f"rank{rank}.stacks"
        stacks = stacks_path.read_text().strip() if stacks_path.exists() else ""
        where = f"; its stacks before the kill:\n{stacks}" if stacks else ""
        return (f"--- rank {rank} was killed (exit code {process.exitcode}): it hung past the timeout, "
                f"or was stopped after another rank failed{where}")
    return f"--- rank {rank} exited with code {process.exitcode} without a result"


def _entry(worker: Callable, args: tuple, rank: int, world_size: int, port: int, threads: int,
           results_dir: str, environment: dict[str, str]) -> None:
    os.environ.clear()  # the fork server's environment is the parent's as it was at the first job
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)  # N processes share the machine's few cores
    path = Path(results_dir) / f"rank{rank}.pkl"
    stacks = (Path(results_dir) / f"rank{rank}.stacks").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        dist.init_process_group("gloo")
        outcome = ("ok", worker(*args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        outcome = ("error", traceback.format_exc())
    _write(path, outcome)
    if outcome[0] != "ok":
        os._exit(1)  # peers may be blocked in a collective with us: do not wait for them
    if dist.is_initialized():
        dist.destroy_process_group()


# --- pytest glue ---------------------------------------------------------------------------------

_OUTCOMES: dict[tuple[str, str], CaseOutcome] = {}


@pytest.fixture
def case_outcome(request) -> Callable[[Callable, dict, str], CaseOutcome]:
    """`case_outcome(case_fn, cases, name)`: the outcome of `case_fn(cases[name])` on every rank.

    A test module lists its cases (`{name: case}`, each with a `world_size`) and parametrizes a
    test over the names as `case_name`. The first test asking for an outcome runs every selected
    case of its module with that world size in one job; the others read the cached outcome.
    Cases marked xfail run last, so that their failure, which ends a job, does not cost the
    passing cases a second start.
    """

    def get(case_fn: Callable, cases: dict, name: str) -> CaseOutcome:
        key = (f"{case_fn.__module__}.{case_fn.__name__}", name)
        if key not in _OUTCOMES:
            world_size = cases[name].world_size
            group = [other for other in _selected(request, cases)
                     if cases[other].world_size == world_size and (key[0], other) not in _OUTCOMES]
            group = group if name in group else [name] + group
            timeout_s = max(getattr(cases[other], "timeout_s", 45.0) for other in group)
            results = run_cases(case_fn, world_size, {other: cases[other] for other in group},
                                timeout_per_case_s=timeout_s)
            _OUTCOMES.update({(key[0], other): outcome for other, outcome in results.items()})
        return _OUTCOMES[key]

    return get


def _selected(request, cases: dict) -> list[str]:
    """Names of the cases whose tests in this module are selected, expected failures last."""
    passing, failing = [], []
    for item in request.session.items:
        if item.module is not request.module or not hasattr(item, "callspec"):
            continue
        name = item.callspec.params.get("case_name")
        if name in cases and name not in passing + failing:
            (failing if item.get_closest_marker("xfail") else passing).append(name)
    return passing + failing


def launch_like_torchrun(command: list[str], world_size: int, *, timeout_s: float = 240.0,
                         cwd: str | None = None, env_per_rank: Callable[[int], dict] | None = None
                         ) -> list[tuple[int, str]]:
    """Start `world_size` processes of `command` with the environment torchrun gives each rank
    (plus `env_per_rank(rank)`); their exit codes and output (stdout and stderr), in rank order."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", **(env_per_rank(rank) if env_per_rank else {}))
        processes.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()  # only processes this call started
            output, _ = process.communicate()
        results.append((process.returncode, output))
    return results

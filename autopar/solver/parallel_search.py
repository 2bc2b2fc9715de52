"""The search over meshes in forked worker processes (SearchOptions.jobs > 1), and how many.

Meshes (tp, pp, dp, cp) are priced independently of one another, except for what they must beat:
the `keep` best step times found so far. Workers are forked once the graph is captured, so
each inherits the planner, its condensed graph and its caches without pickling anything; they
share the board of best times (SharedBoard), so that each prunes with what all have found.

- Work units are the meshes of one tensor-parallel degree: the intra-op solve and the
  sequence split of a (tp, microbatch) are then computed in one worker only. With more jobs
  than degrees the largest units are halved, and their halves solve the same ILPs twice.
  Workers take the next unit, largest first, until none is left; within a unit the meshes go
  in the order search.Planner._promising_first gives them.
- Each worker sends back its best `keep` (board.Found), the configurations it priced, its
  leanest estimate, and the intra-op results and segment costs its ranked estimates were
  priced from (the plan is built from them in this process, without solving again).
- The merge sorts by (step time, peak memory, mesh number, order found), which is the order a
  search in one process keeps: the ranked plans are the same for any number of jobs. Only the
  count of configurations priced may differ (a worker prunes with the times found so far).
- A worker that fails sends its error, which is raised here; one that dies without a result
  is a SearchWorkerError. On any exception here (Ctrl-C included) every worker is terminated
  and joined before it propagates; workers ignore SIGINT and, on Linux, die with this process.

How many processes (search_jobs): SearchOptions.jobs, else $AUTOPAR_JOBS, else the usable cores
(at most MAX_DEFAULT_JOBS, one per MIN_MESHES_PER_JOB meshes); one without os.fork or while
other Python threads run. This module imports the board (board.py), never the search that uses it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback
from multiprocessing.connection import wait

from autopar.errors import AutoparError, ConfigError
from autopar.solver.board import Found


class SearchWorkerError(AutoparError, RuntimeError):
    """A process of a parallel search failed or died without its result."""


JOBS_ENV = "AUTOPAR_JOBS"
"""Environment variable: processes of a search whose options leave `jobs` unset."""
MAX_DEFAULT_JOBS = 8
MIN_MESHES_PER_JOB = 8
"""A search of fewer meshes per process runs in one: forking costs more than it saves."""


def search_jobs(jobs: int | None, meshes: list) -> int:
    """How many processes price the meshes: `jobs` (or $AUTOPAR_JOBS) as asked, else the usable
    cores up to MAX_DEFAULT_JOBS, fewer for a small search, and 1 while other Python threads run;
    1 where os.fork is unavailable."""
    if jobs is None and os.environ.get(JOBS_ENV, "").strip():
        jobs = _jobs_from_env(os.environ[JOBS_ENV])
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1  # no fork (Windows): the workers could not inherit the captured graph
    if jobs is None and threading.active_count() > 1:
        return 1  # forking a multi-threaded process (a notebook's kernel) may deadlock its children
    if jobs is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")  # torchrun: the node's processes share the cores
        cores //= max(1, int(local)) if local.isdigit() else 1
        jobs = min(cores, MAX_DEFAULT_JOBS, len(meshes) // MIN_MESHES_PER_JOB)
    return max(1, min(jobs, len(meshes)))


def check_jobs_env() -> None:
    """A bad $AUTOPAR_JOBS raises ConfigError now (before a capture that may take seconds)."""
    if os.environ.get(JOBS_ENV, "").strip():
        _jobs_from_env(os.environ[JOBS_ENV])


def _jobs_from_env(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ConfigError(f"{JOBS_ENV}={text!r}: give the number of processes that price configurations, an "
                          f"integer >= 1 (1: search in this process), or unset it")
    return jobs



class SharedBoard:
    """board.Board in shared memory: the `keep` best step times found by any worker."""

    def __init__(self, context, keep: int) -> None:
        self.keep = keep
        self._times = context.Array("d", [float("inf")] * keep)

    def cutoff_s(self) -> float:
        return self._times.get_obj()[self.keep - 1]  # one aligned double: read without the lock

    def offer(self, time_s: float) -> None:
        with self._times.get_lock():
            times = self._times.get_obj()
            if time_s >= times[self.keep - 1]:
                return
            slot = self.keep - 1
            while slot > 0 and times[slot - 1] > time_s:
                times[slot] = times[slot - 1]
                slot -= 1
            times[slot] = time_s


def work_units(meshes: list[tuple[int, int, int, int]], jobs: int) -> list[list[tuple[int, tuple]]]:
    """Numbered meshes grouped by tp (largest group first), halved while there are fewer groups
    than jobs."""
    groups: dict[int, list[tuple[int, tuple]]] = {}
    for index, mesh in enumerate(meshes):
        groups.setdefault(mesh[0], []).append((index, mesh))
    # Largest first; of equal size the larger tp first: a smaller replica fits in more ways,
    # so more of its configurations are priced (Llama 3 405B: tp 8 took 11x tp 1's CPU time).
    size = lambda unit: (len(unit), unit[0][1][0])  # noqa: E731
    units = sorted(groups.values(), key=size, reverse=True)
    while len(units) < jobs and len(units[0]) > 1:
        largest = units.pop(0)
        units += [largest[0::2], largest[1::2]]  # alternate meshes: both halves get small and large pp
        units.sort(key=size, reverse=True)
    return units


def search_in_workers(planner, meshes: list[tuple[int, int, int, int]], constraints, keep: int, offload: bool,
                      jobs: int) -> Found:
    """search.Planner._search_pass over `jobs` forked processes (see the module's docstring)."""
    context = multiprocessing.get_context("fork")
    units = work_units(meshes, jobs)
    board = SharedBoard(context, keep)
    next_unit = context.Value("i", 0)
    workers, connections = [], []
    try:
        for _ in range(min(jobs, len(units))):
            receive, send = context.Pipe(duplex=False)
            worker = context.Process(target=_work, args=(planner, units, next_unit, constraints, keep, offload,
                                                         board, send), daemon=True)
            worker.start()
            send.close()
            workers.append(worker)
            connections.append(receive)
        results = _collect(workers, connections)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            worker.join()
        for connection in connections:
            connection.close()
    return _merge(planner, results, keep)


def _work(planner, units, next_unit, constraints, keep, offload, board, send) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the workers
    _die_with_parent()
    try:
        found = Found()
        before = set(planner.pricing.solves)
        while True:
            with next_unit.get_lock():
                taken = next_unit.value
                next_unit.value += 1
            if taken >= len(units):
                break
            part = planner.search_meshes(units[taken], constraints, keep, offload, board)
            found = _combine(found, part, keep)
        found.sharding_keys = set(planner.pricing.solves) - before
        send.send(("ok", found, _priced_from(planner, found)))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent
        send.send(("error", _picklable(error), traceback.format_exc()))
    finally:
        send.close()


def _die_with_parent() -> None:
    """Linux: the kernel ends this worker if the parent dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _combine(found: Found, part: Found, keep: int) -> Found:
    for key, estimate in part.ranked:
        found.add(key, estimate, keep)
    found.count += part.count
    if part.least_memory and (found.least_memory is None or part.least_memory[0] < found.least_memory[0]):
        found.least_memory = part.least_memory
    return found


def _priced_from(planner, found: Found) -> dict:
    """The intra-op results and segment costs of the ranked estimates, for the plan."""
    sharding, costs = {}, {}
    for _, estimate in found.ranked:
        config = estimate.config
        key = planner.tp_key(config.tp, config.microbatch_size, config.sequence_parallel)
        folded = ("folded",) if config.folds_experts else ()  # MoE parallel folding's own solve (pricing.py)
        sharding[key + folded] = planner.sharding(*key, config.folds_experts)
        for cp in {1, config.cp}:
            if key + (cp,) + folded in planner.pricing.costs:
                costs[key + (cp,) + folded] = planner.pricing.costs[key + (cp,) + folded]
    return dict(sharding=sharding, costs=costs)


def _picklable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception that does not pickle is sent as its text
        return RuntimeError(f"{type(error).__name__}: {error}")


def _collect(workers, connections) -> list[tuple[Found, dict]]:
    results, waiting = [], dict(zip(connections, workers))
    while waiting:
        for connection in wait(list(waiting)):
            worker = waiting.pop(connection)
            try:
                message = connection.recv()
            except EOFError:
                worker.join()
                raise SearchWorkerError(
                    f"a search worker (process {worker.pid}) exited with code {worker.exitcode} before sending its "
                    "result (killed, or out of memory?); search in one process with jobs=1 (autopar plan --jobs 1, "
                    "or AUTOPAR_JOBS=1)") from None
            if message[0] == "error":
                _, error, text = message
                if isinstance(error, (AutoparError, KeyboardInterrupt)):
                    raise error
                last = text.strip().splitlines()[-1] if text.strip() else repr(error)
                raise SearchWorkerError(f"a search worker (process {worker.pid}) failed: {last}; search in one "
                                        f"process with jobs=1 to debug it. The worker's traceback:\n{text}") from error
            results.append(message[1:])
    return results


def _merge(planner, results: list[tuple[Found, dict]], keep: int) -> Found:
    merged = Found()
    for found, priced in results:
        merged = _combine(merged, found, keep)
        merged.sharding_keys |= found.sharding_keys
        for key, sharding in priced["sharding"].items():
            planner.pricing.solves.setdefault(key, sharding)
        for key, costs in priced["costs"].items():
            planner.pricing.costs.setdefault(key, costs)
    return merged

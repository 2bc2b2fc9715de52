"""The search in forked worker processes (solver/parallel_search.py) ranks as one process does."""

import multiprocessing
import os

import pytest

from autopar import api
from autopar.plans import planning
from autopar.cli import build_parser
from autopar.cluster import Cluster
from autopar.errors import ConfigError
from autopar.solver import parallel_search
from autopar.solver.parallel_search import JOBS_ENV, SearchWorkerError, SharedBoard, search_jobs, work_units
from autopar.solver.constraints import Constraints
from autopar.solver.board import Board
from autopar.solver.search import Planner, SearchOptions

# Four layers, a sequence cp may split (2048 tokens: cp up to 2), 16 GPUs: 4 tp degrees.
MODEL = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=256,seq=2048,vocab=512"
CLUSTER = "dgx-a100-80g:nodes=2"
BATCH = 32


@pytest.fixture(scope="module")
def graph():
    return api.capture_for_planning(MODEL)


def _planner(graph, jobs: int) -> Planner:
    return api.planner_for(graph, None, Cluster.from_spec(CLUSTER), global_batch=BATCH,
                           options=SearchOptions(jobs=jobs))


def _ranked(result):
    return [(e.config, e.step_time_s, e.peak_memory_bytes, [s.recompute for s in e.stages], e.breakdown_s)
            for e in result.ranked]


def _no_workers_left():
    return [child for child in multiprocessing.active_children() if child.is_alive()] == []


@pytest.fixture(scope="module")
def alone(graph):
    planner = _planner(graph, 1)
    return planner, planner.search()


def _plan(planner, result):
    """api.plan_with over a search already made (candidates_with asks for the best 5)."""
    planner.search = lambda constraints, keep: result
    return api.plan_with(planner)


def test_ranked_plans_with_two_jobs_equal_one_job(graph, alone, monkeypatch):
    import autopar.solver.pricing as pricing_module

    planner = _planner(graph, 2)
    assert len({mesh[0] for mesh in planner.candidates.meshes(Constraints())}) == 4  # work units: one per tp degree
    solved_here = []
    solve = pricing_module.solve_sharding
    monkeypatch.setattr(pricing_module, "solve_sharding", lambda *a, **k: solved_here.append(1) or solve(*a, **k))
    paired = planner.search()  # the workers are forked: their solves are not counted here
    assert _ranked(paired) == _ranked(alone[1])  # exactly: the same float arithmetic in each process
    assert _no_workers_left()
    # The plan is built from the workers' intra-op results (this process solved nothing). Each worker
    # sends those of its own ranked configurations, so keys of configurations that a worker ranked
    # but the merged top list dropped may come too (how many depends on the workers' timing).
    best = paired.best.config
    assert not solved_here
    assert {planner.tp_key(e.config.tp, e.config.microbatch_size) for e in paired.ranked} <= set(planner.pricing.solves)
    assert paired.num_sharding_solves == alone[1].num_sharding_solves
    strip = lambda plan: {k: v for k, v in plan.to_dict().items() if k != "search"}  # noqa: E731
    assert strip(_plan(planner, paired)) == strip(_plan(*alone))
    assert planner.tp_key(best.tp, best.microbatch_size) in planner.pricing.solves


def test_more_jobs_than_tensor_parallel_degrees(graph, alone):
    """Six jobs on four tp degrees: two degrees' meshes are split over two workers each."""
    assert _ranked(_planner(graph, 6).search()) == _ranked(alone[1])


def test_work_units_group_meshes_by_tp_and_halve_the_largest():
    meshes = [(tp, pp, 8 // (tp * pp), 1) for tp in (1, 2, 4) for pp in (1, 2) if 8 % (tp * pp) == 0]
    units = work_units(meshes, 2)
    assert len(units) == 3 and [len(unit) for unit in units] == [2, 2, 2]
    assert all(len({mesh[0] for _, mesh in unit}) == 1 for unit in units)
    halved = work_units(meshes, 5)
    assert len(halved) == 5
    assert sorted(index for unit in halved for index, _ in unit) == list(range(len(meshes)))
    assert all(meshes[index] == mesh for unit in halved for index, mesh in unit)


@pytest.mark.parametrize("make", [lambda keep: Board(keep),
                                  lambda keep: SharedBoard(multiprocessing.get_context("fork"), keep)])
def test_boards_keep_the_best_times(make):
    board = make(3)
    assert board.cutoff_s() == float("inf")
    for time_s in (5.0, 7.0):
        board.offer(time_s)
    assert board.cutoff_s() == float("inf")
    for time_s in (6.0, 1.0, 9.0, 6.0):
        board.offer(time_s)
    assert board.cutoff_s() == 6.0  # best three: 1, 5, 6


def test_jobs_option_and_environment(monkeypatch):
    meshes = [(1, 1, 1, 1)] * 40
    monkeypatch.delenv(JOBS_ENV, raising=False)
    assert search_jobs(3, meshes) == 3
    assert search_jobs(3, meshes[:2]) == 2  # no more processes than meshes
    assert search_jobs(None, meshes[:3]) == 1  # a small search stays in this process
    monkeypatch.setenv(JOBS_ENV, "1")
    assert search_jobs(None, meshes) == 1
    assert search_jobs(2, meshes) == 2  # the option wins over the environment
    monkeypatch.setenv(JOBS_ENV, "many")
    with pytest.raises(ConfigError, match=JOBS_ENV):
        search_jobs(None, meshes)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="jobs"):
            SearchOptions(jobs=bad)
    monkeypatch.delenv(JOBS_ENV)
    import threading
    monkeypatch.setattr(threading, "active_count", lambda: 3)
    assert search_jobs(None, meshes) == 1  # other threads: no fork unless asked for
    assert search_jobs(2, meshes) == 2
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert search_jobs(4, meshes) == 1  # no fork: one process


def test_cli_jobs_flag():
    args = build_parser().parse_args(["plan", "tiny-gpt", "--cluster", "cpu", "--global-batch", "4", "--jobs", "3"])
    assert args.jobs == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "tiny-gpt", "--cluster", "cpu", "--global-batch", "4", "--jobs", "0"])


def _fail_in_worker(monkeypatch, action):
    parent = os.getpid()
    original = Planner.search_meshes

    def search_meshes(self, *args, **kwargs):
        if os.getpid() != parent:
            action()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Planner, "search_meshes", search_meshes)


def test_a_user_error_in_a_worker_is_raised_as_itself(graph, monkeypatch):
    def fail():
        raise ConfigError("bad constraint seen in a worker")
    _fail_in_worker(monkeypatch, fail)
    with pytest.raises(ConfigError, match="bad constraint seen in a worker"):
        _planner(graph, 2).search()
    assert _no_workers_left()


def test_a_bug_in_a_worker_names_the_worker_and_its_traceback(graph, monkeypatch):
    def fail():
        raise ZeroDivisionError("boom")
    _fail_in_worker(monkeypatch, fail)
    with pytest.raises(SearchWorkerError, match="(?s)ZeroDivisionError.*jobs=1"):
        _planner(graph, 2).search()
    assert _no_workers_left()


def test_a_worker_that_dies_is_reported(graph, monkeypatch):
    _fail_in_worker(monkeypatch, lambda: os._exit(3))
    with pytest.raises(SearchWorkerError, match="exited with code 3"):
        _planner(graph, 2).search()
    assert _no_workers_left()


def test_interrupting_the_search_ends_every_worker(graph, monkeypatch):
    def interrupted(connections):
        raise KeyboardInterrupt
    monkeypatch.setattr(parallel_search, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _planner(graph, 2).search()
    assert _no_workers_left()


def test_the_jobs_setting_keeps_the_capture_cache_key(monkeypatch):
    from autopar.capture import cache as capture_cache
    from autopar.models import resolve_spec

    resolved = resolve_spec("tiny-gpt")
    key = lambda: capture_cache.spec_key(resolved, loss_fn=None, example_targets=None, precision="bf16",  # noqa: E731
                                         reuse_blocks=True)
    monkeypatch.delenv(JOBS_ENV, raising=False)
    before = key()
    monkeypatch.setenv(JOBS_ENV, "3")
    assert key() == before
    monkeypatch.setenv("AUTOPAR_SOMETHING_ELSE", "3")
    assert key() != before


def test_a_bad_jobs_environment_is_refused_before_the_capture(monkeypatch):
    monkeypatch.setenv(JOBS_ENV, "0")

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before checking AUTOPAR_JOBS")

    monkeypatch.setattr(planning, "planner_for", no_capture)
    with pytest.raises(ConfigError, match=JOBS_ENV):
        api.plan("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64", cluster="dgx-a100-80g:nodes=1", global_batch=8)

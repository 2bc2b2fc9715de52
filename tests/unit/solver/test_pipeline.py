"""Stage partitioning against brute force."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.solver.pipeline import ChainCosts, StageSpan, partition, stage_memory


def brute_force(costs: ChainCosts, num_stages: int, in_flight, budget):
    best = None
    count = len(costs)
    for cuts in itertools.combinations(range(1, count), num_stages - 1):
        bounds = (0,) + cuts + (count,)
        spans = [StageSpan(a, b) for a, b in zip(bounds, bounds[1:])]
        if budget is not None and any(stage_memory(costs, s, in_flight(k)) > budget for k, s in enumerate(spans)):
            continue
        worst = max(costs.total("time_s", s) for s in spans)
        if best is None or worst < best:
            best = worst
    return best


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=9), stages=st.integers(1, 4),
       budget_factor=st.one_of(st.none(), st.floats(0.3, 2.0)))
def test_partition_matches_brute_force(times, stages, budget_factor):
    states = [t * 3 for t in times]
    activations = [t * 0.5 for t in reversed(times)]
    costs = ChainCosts(time_s=times, state_bytes=states, activation_bytes=activations)
    in_flight = lambda stage: float(stages - stage)  # noqa: E731 - 1F1B
    budget = None if budget_factor is None else budget_factor * (sum(states) + stages * sum(activations)) / stages
    expected = brute_force(costs, stages, in_flight, budget) if stages <= len(times) else None
    spans = partition(costs, stages, in_flight=in_flight, memory_budget_bytes=budget)
    if expected is None:
        assert spans is None
        return
    assert spans is not None and len(spans) == stages
    assert spans[0].start == 0 and spans[-1].stop == len(times)
    assert all(a.stop == b.start and a.stop > a.start for a, b in zip(spans, spans[1:]))
    worst = max(costs.total("time_s", s) for s in spans)
    assert worst == pytest.approx(expected, rel=2e-4)
    if budget is not None:
        assert all(stage_memory(costs, s, in_flight(k)) <= budget * (1 + 1e-9) for k, s in enumerate(spans))


def test_identical_blocks_split_evenly():
    costs = ChainCosts(time_s=[1.0] * 8, state_bytes=[0.0] * 8, activation_bytes=[0.0] * 8)
    spans = partition(costs, 4, in_flight=lambda stage: 1.0)
    assert [(s.start, s.stop) for s in spans] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_too_many_stages_or_no_fit():
    costs = ChainCosts(time_s=[1.0, 1.0], state_bytes=[10.0, 10.0], activation_bytes=[0.0, 0.0])
    assert partition(costs, 3, in_flight=lambda stage: 1.0) is None
    assert partition(costs, 2, in_flight=lambda stage: 1.0, memory_budget_bytes=5.0) is None

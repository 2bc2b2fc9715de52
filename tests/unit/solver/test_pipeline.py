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


# --- splits by count, as the frameworks cut --------------------------------------------------

from autopar.errors import ConfigError  # noqa: E402
from autopar.solver.pipeline import check_pipeline_split, split_blocker, split_counts, split_spans  # noqa: E402


def _spans(is_block, num_chunks, split):
    return [(span.start, span.stop) for span in split_spans(is_block, num_chunks, split)]


GPT_SEGMENTS = (False,) + (True,) * 8 + (False,)
"""prologue (embedding), 8 blocks, epilogue (final norm, output layer, loss)."""


def test_uniform_puts_equal_blocks_per_chunk_the_embedding_first_and_the_head_last():
    assert _spans(GPT_SEGMENTS, 4, "uniform") == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert split_counts(96, 24, "uniform") == [4] * 24  # Korthikanti et al.'s 175B: pp 8 x vp 3
    assert _spans((True,) * 4, 2, "uniform") == [(0, 2), (2, 4)]  # no embedding or head segments
    between = (False, True, True, False, True, True, False)  # a segment between blocks rides with the one before
    assert _spans(between, 2, "uniform") == [(0, 4), (4, 7)]


def test_counting_the_embedding_and_head_as_blocks_gives_their_chunks_one_fewer():
    # BLOOM on Megatron-DeepSpeed ('type:transformer|embedding'): 70 + 2 = 12 x 6.
    assert split_counts(70, 12, "uniform:embedding,head") == [5] + [6] * 10 + [5]
    # Llama 3 405B (Dubey et al. section 3.3.2): 126 + 2 = 16 x 8 chunks, the ends hold no layer.
    assert split_counts(126, 128, "uniform:embedding,head") == [0] + [1] * 126 + [0]
    assert _spans((False,) + (True,) * 126 + (False,), 128, "uniform:embedding,head")[:2] == [(0, 1), (1, 2)]
    assert split_counts(9, 5, "uniform:head") == [2, 2, 2, 2, 1]
    assert split_counts(9, 5, "uniform:embedding") == [1, 2, 2, 2, 2]


def test_first_and_last_counts_fix_the_end_chunks_and_split_the_rest_evenly():
    assert split_counts(126, 8, "first=15,last=15") == [15] + [16] * 6 + [15]
    assert split_counts(7, 4, "first=1") == [1, 2, 2, 2]
    assert split_counts(7, 4, "last=4") == [1, 1, 1, 4]
    assert _spans(GPT_SEGMENTS, 4, "first=1,last=3") == [(0, 2), (2, 4), (4, 6), (6, 10)]
    assert _spans(GPT_SEGMENTS, 3, "first=0,last=0") == [(0, 1), (1, 9), (9, 10)]


def test_a_split_that_does_not_divide_is_refused_with_the_counts():
    with pytest.raises(ConfigError, match="70 repeated blocks does not divide by 12"):
        split_spans((False,) + (True,) * 70 + (False,), 12, "uniform")
    with pytest.raises(ConfigError, match="8 repeated blocks \\+ the embedding \\+ the head = 10 does not divide by 4"):
        split_counts(8, 4, "uniform:embedding,head")
    with pytest.raises(ConfigError, match="leaves 5 of the 8 repeated blocks for the other 2 of 4"):
        split_counts(8, 4, "first=1,last=2")
    with pytest.raises(ConfigError, match="puts 9 repeated blocks on the end chunks, more than the model's 8"):
        split_counts(8, 4, "first=4,last=5")
    with pytest.raises(ConfigError, match="chunk\\(s\\) \\[0, 2\\] of 3 empty"):
        split_spans((True,) * 4, 3, "first=0,last=0")
    assert "does not divide" in split_blocker(GPT_SEGMENTS, 3, "uniform")
    assert split_blocker(GPT_SEGMENTS, 4, "uniform") == "" == split_blocker(GPT_SEGMENTS, 4, "balanced")


@pytest.mark.parametrize("text, canonical", [("balanced", "balanced"), ("Uniform", "uniform"),
                                             ("uniform:head, embedding", "uniform:embedding,head"),
                                             ("last=2,first=1", "first=1,last=2"), ("last=0", "last=0")])
def test_splits_have_one_spelling(text, canonical):
    assert check_pipeline_split(text) == canonical


@pytest.mark.parametrize("bad", ["", "even", "uniform:", "uniform:loss", "uniform:head,head", "first=-1",
                                 "first=1,first=2", "middle=3", 3, None])
def test_unknown_splits_are_refused_naming_the_forms(bad):
    with pytest.raises(ConfigError, match="'uniform:embedding,head'"):
        check_pipeline_split(bad)

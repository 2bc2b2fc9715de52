"""Pipeline stage boundaries: split a chain of segments into contiguous stages.

Minimises the slowest stage's time subject to each stage fitting in memory:

    minimise   max_k  sum_{i in stage k} time_i
    subject to sum_{i in stage k} state_bytes_i + in_flight(k) x sum_{i in stage k} activation_bytes_i
               + fixed_bytes <= budget                                              for every k

in_flight(k) falls with the stage index (1F1B: p - k), so filling early stages as full as the
bound allows never hurts later ones: a greedy left-to-right packing decides whether a bound T is
achievable, and bisection on T finds the smallest (to a relative 1e-4), from a bracket grown
above the even share. With prefix sums each greedy pass costs O(p log n) for p stages over n
segments. No torch here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StageSpan:
    """Segments [start, stop) form one stage."""

    start: int
    stop: int


@dataclass(frozen=True, kw_only=True)
class ChainCosts:
    """Per segment, for one microbatch on one device."""

    time_s: Sequence[float]
    state_bytes: Sequence[float]
    """Parameters, gradients, optimizer states and buffers (independent of microbatches)."""
    activation_bytes: Sequence[float]
    """Kept for backward, per microbatch in flight."""
    _prefix: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.time_s)

    def prefix(self, name: str) -> np.ndarray:
        if name not in self._prefix:
            self._prefix[name] = np.concatenate(([0.0], np.cumsum(np.asarray(getattr(self, name), dtype=float))))
        return self._prefix[name]

    def prefix_list(self, name: str) -> list[float]:
        """prefix(name) as plain floats: indexing a list is several times cheaper than numpy's."""
        listed = self._prefix.get((name, list))
        if listed is None:
            listed = self._prefix[(name, list)] = self.prefix(name).tolist()
        return listed

    def total(self, name: str, span: StageSpan) -> float:
        listed = self.prefix_list(name)
        return listed[span.stop] - listed[span.start]


def stage_memory(costs: ChainCosts, span: StageSpan, in_flight: float, fixed_bytes: float = 0.0) -> float:
    return costs.total("state_bytes", span) + in_flight * costs.total("activation_bytes", span) + fixed_bytes


def partition(costs: ChainCosts, num_stages: int, *, in_flight: Callable[[int], float],
              memory_budget_bytes: float | None = None, fixed_bytes: float = 0.0,
              at_least_s: float = 0.0) -> list[StageSpan] | None:
    """Best split into exactly `num_stages` stages, or None if no split fits in memory.
    `at_least_s`: a bound the slowest stage cannot beat (a memory-bounded split is no faster
    than the best split without the bound), where the search starts."""
    count = len(costs)
    if num_stages < 1 or num_stages > count:
        return None
    packer = _Packer(costs, num_stages, in_flight, memory_budget_bytes, fixed_bytes)
    high = float(costs.prefix("time_s")[-1])
    best = packer.stops(high)
    if best is None:
        return None
    high = packer.slowest_s(best)
    # No stage is faster than an even share or the slowest segment; the answer is usually just
    # above that, so bracket it by growing steps before bisecting. A packing that succeeds
    # lowers the bracket's top to its own slowest stage (a chain of identical blocks has few
    # distinct stage times, so this often lands on the answer).
    low = max(max(costs.time_s), high / num_stages, at_least_s)
    step = 1e-3
    while low * (1 + step) < high:
        probe = low * (1 + step)
        found = packer.stops(probe)
        if found is not None:
            high, best = packer.slowest_s(found), found
            break
        low, step = probe, step * 4
    while high - low > 1e-4 * high:
        middle = (low + high) / 2
        found = packer.stops(middle)
        if found is None:
            low = middle
        else:
            high, best = packer.slowest_s(found), found
    return _split_to([StageSpan(start, stop) for start, stop in zip([0] + best, best)], num_stages, costs)


class _Packer:
    """Greedy packing under a time bound, with per-stage memory limits (bisect on prefix sums;
    plain lists, which beat numpy calls on arrays of a few hundred segments)."""

    def __init__(self, costs: ChainCosts, num_stages: int, in_flight, budget, fixed_bytes) -> None:
        self.count = len(costs)
        self.num_stages = num_stages
        self.time_prefix = costs.prefix_list("time_s")
        self.budget = budget
        self.memory_prefix: list[list[float] | None] = []
        if budget is not None:
            self._states, self._activations = costs.prefix("state_bytes"), costs.prefix("activation_bytes")
            self._factors = [in_flight(stage) for stage in range(num_stages)]
            self._rows: dict[float, list[float]] = {}
            # Built when a packing first reaches the stage: most packings that fail (the model
            # does not fit) fail in the first stages, which hold the most microbatches.
            self.memory_prefix = [None] * num_stages
            self.room = budget - fixed_bytes

    def _memory_row(self, stage: int) -> list[float]:
        """Prefix sums of the stage's memory per segment (states + its in-flight x activations)."""
        factor = self._factors[stage]
        row = self._rows.get(factor)
        if row is None:
            row = self._rows[factor] = (self._states + factor * self._activations).tolist()
        self.memory_prefix[stage] = row
        return row

    def slowest_s(self, stops: list[int]) -> float:
        """The slowest stage's time of a packing."""
        prefix = self.time_prefix
        return max(prefix[stop] - prefix[start] for start, stop in zip([0] + stops, stops))

    def stops(self, bound_s: float) -> list[int] | None:
        """Where each stage of the greedy packing ends (plain ints: this runs thousands of times)."""
        stops: list[int] = []
        start, count, num_stages = 0, self.count, self.num_stages
        time_prefix, memory_prefix, room = self.time_prefix, self.memory_prefix, getattr(self, "room", 0.0)
        bisect_right = bisect.bisect_right
        slack = bound_s * (1 + 1e-12)
        while start < count:
            stage = len(stops)
            if stage >= num_stages:
                return None
            stop = bisect_right(time_prefix, time_prefix[start] + slack) - 1
            if memory_prefix:
                memory = memory_prefix[stage]
                if memory is None:
                    memory = self._memory_row(stage)
                stop = min(stop, bisect_right(memory, memory[start] + room) - 1)
            if stop <= start:
                return None
            stop = min(stop, count)
            stops.append(stop)
            start = stop
        return stops


def _split_to(spans: list[StageSpan], num_stages: int, costs: ChainCosts) -> list[StageSpan]:
    """Split the slowest multi-segment stages until there are exactly `num_stages`."""
    spans = list(spans)
    while len(spans) < num_stages:
        candidates = [(costs.total("time_s", s), i) for i, s in enumerate(spans) if s.stop - s.start > 1]
        _, index = max(candidates)
        span = spans[index]
        middle = _balanced_cut(costs, span)
        spans[index:index + 1] = [StageSpan(span.start, middle), StageSpan(middle, span.stop)]
    return spans


def _balanced_cut(costs: ChainCosts, span: StageSpan) -> int:
    prefix = costs.prefix("time_s")
    half = (prefix[span.start] + prefix[span.stop]) / 2
    cut = int(np.searchsorted(prefix, half))
    candidates = [c for c in (cut - 1, cut, cut + 1) if span.start < c < span.stop]
    return min(candidates, key=lambda c: abs(prefix[c] - half))


# --- which rank runs which pipeline stage ----------------------------------------------------
# Most schedules place global stage s on rank s mod p (loop layout: a rank's chunks are
# s = rank, rank + p, ...). ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6) runs
# exactly two chunks per rank in a V: rank k holds stages k and 2p - 1 - k, so the first and the
# last stage share rank 0 and the turn of the V (stages p - 1 and p) stays on rank p - 1.

V_SCHEDULES = ("zbv",)
"""Schedules with the V layout (two chunks per rank)."""


def stage_of(schedule: str, *, rank: int, chunk: int, num_ranks: int) -> int:
    """Global pipeline stage of `rank`'s local chunk `chunk` (0-based, in pipeline order)."""
    if schedule in V_SCHEDULES:
        if chunk not in (0, 1):
            raise ValueError(f"{schedule} has two chunks per rank, got chunk {chunk}")
        return rank if chunk == 0 else 2 * num_ranks - 1 - rank
    return chunk * num_ranks + rank


def rank_of(schedule: str, *, stage: int, num_ranks: int) -> int:
    """Pipeline rank that runs global stage `stage`."""
    if schedule in V_SCHEDULES:
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def stages_of_rank(schedule: str, *, rank: int, num_ranks: int, num_chunks: int) -> list[int]:
    """Global stages of `rank`, in its local chunk order."""
    return [stage_of(schedule, rank=rank, chunk=chunk, num_ranks=num_ranks) for chunk in range(num_chunks)]

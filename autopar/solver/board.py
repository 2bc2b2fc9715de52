"""What a search keeps as it prices: the `keep` best step times so far (Board, the cutoff a
configuration's lower bound must beat) and the best estimates found (Found). Both the search in
one process (search.py) and its forked workers (parallel_search.py) import them from here, so
that the pool never imports the search that uses it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from autopar.solver.configs import Estimate


class Board:
    """The `keep` best step times found so far, fastest first: a configuration whose lower
    bound exceeds the last of them is not priced (in one process; parallel_search.SharedBoard
    is the one its workers share)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.times_s: list[float] = []

    def cutoff_s(self) -> float:
        return self.times_s[self.keep - 1] if len(self.times_s) >= self.keep else float("inf")

    def offer(self, time_s: float) -> None:
        bisect.insort(self.times_s, time_s)
        del self.times_s[self.keep:]


@dataclass
class Found:
    """What a search of some meshes found: the best `keep` fitting estimates by (step time, peak
    memory, mesh number, order found), the configurations priced, the leanest estimate."""

    ranked: list[tuple[tuple, Estimate]] = field(default_factory=list)
    count: int = 0
    least_memory: tuple[tuple, Estimate] | None = None
    """(peak memory, mesh number, order found) and the estimate, fitting or not."""
    order: int = 0
    sharding_keys: set = field(default_factory=set)
    """(tp, microbatch) of the intra-op solves made in workers (none in one process)."""

    def add(self, key: tuple, estimate: Estimate, keep: int) -> None:
        bisect.insort(self.ranked, (key, estimate), key=lambda entry: entry[0])
        del self.ranked[keep:]

"""Pipeline stage boundaries: split a chain of segments into contiguous stages.

Minimises the slowest stage's time subject to each stage fitting in memory:

    minimise   max_k  sum_{i in stage k} time_i
    subject to sum_{i in stage k} state_bytes_i + in_flight(k) x sum_{i in stage k} activation_bytes_i
               + fixed_bytes <= budget                                              for every k

in_flight(k) falls with the stage index (1F1B: p - k), so filling early stages as full as the
bound allows never hurts later ones: a greedy left-to-right packing decides whether a bound T is
achievable, and bisection on T finds the smallest (to a relative 1e-4), from a bracket grown
above the even share. With prefix sums each greedy pass costs O(p log n) for p stages over n
segments.

That balanced cut is autopar's own (pipeline_split "balanced"). The frameworks that ran published
configurations cut by count instead, whatever the stages cost (split_spans): "uniform" puts the
same number of repeated blocks on every model chunk, with the segments before the first block
(the embedding) on the first chunk and those after the last (final norm, output layer, loss) on
the last, as Megatron-LM and Megatron-Core do by default (num_layers / (pp x vp) per chunk);
"uniform:embedding", "uniform:head" and "uniform:embedding,head" count the embedding and/or the
head as one block more (Megatron-Core's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, Megatron-DeepSpeed's --pp-partition-method
'type:transformer|embedding', torchtitan's split since pytorch/torchtitan#1416); "first=N",
"last=M" or "first=N,last=M" fix the blocks of the first and/or last chunk and split the rest
evenly over the others (Megatron-Core's --decoder-first/last-pipeline-num-layers without
interleaving). A count that does not divide is refused with the counts. No torch here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import ConfigError


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


# --- splits by count, as the frameworks cut ----------------------------------------------------

BALANCED = "balanced"
_SPLIT_FORMS = ("'balanced' (autopar's cut: the slowest stage as fast as it can be), 'uniform' (the same number "
                "of repeated blocks per model chunk, the embedding on the first, the head and loss on the last), "
                "'uniform:embedding', 'uniform:head' or 'uniform:embedding,head' (those counted as one block "
                "more each), or 'first=N', 'last=M', 'first=N,last=M' (blocks of the first and last chunk, "
                "the rest even over the others)")


def check_pipeline_split(value, name: str = "pipeline_split") -> str:
    """The split in its canonical spelling ("uniform:embedding,head", "first=1,last=2"), or
    ConfigError naming the forms."""
    text = value.replace(" ", "").lower() if isinstance(value, str) else None
    if text in (BALANCED, "uniform"):
        return text
    if text and text.startswith("uniform:"):
        parts = text.removeprefix("uniform:").split(",")
        if parts and not set(parts) - {"embedding", "head"} and len(set(parts)) == len(parts):
            return "uniform:" + ",".join(part for part in ("embedding", "head") if part in parts)
    counts = _first_last(text) if text else None
    if counts is not None:
        return ",".join(f"{key}={counts[key]}" for key in ("first", "last") if key in counts)
    raise ConfigError(f"{name} must be {_SPLIT_FORMS}; got {value!r}")


def _first_last(text: str) -> dict[str, int] | None:
    counts: dict[str, int] = {}
    for item in text.split(","):
        key, equals, number = item.partition("=")
        if key not in ("first", "last") or not equals or not number.isdigit() or key in counts:
            return None
        counts[key] = int(number)
    return counts


def split_counts(num_blocks: int, num_chunks: int, split: str) -> list[int]:
    """Repeated blocks per model chunk, in pipeline order, under a split by count; ConfigError
    with the counts when they do not divide."""
    split = check_pipeline_split(split)
    if num_chunks == 1:
        return [num_blocks]
    shown = f"pipeline_split '{split}'"
    if split.startswith("uniform"):
        extra = {"embedding": "embedding" in split, "head": "head" in split}
        counted = num_blocks + sum(extra.values())
        if num_blocks == 0 or counted % num_chunks:
            named = " + ".join([f"{num_blocks} repeated blocks"] + [f"the {key}" for key, on in extra.items() if on])
            named += f" = {counted}" if counted != num_blocks else ""
            raise ConfigError(f"{shown} puts an equal count on each of the {num_chunks} model chunks (pp x chunks per "
                              f"rank), but {named} does not divide by {num_chunks}; use a pp (or "
                              f"interleaving) that divides it, another uniform form, 'first=N,last=M' or 'balanced'")
        each = counted // num_chunks
        counts = [each] * num_chunks
        counts[0] -= extra["embedding"]
        counts[-1] -= extra["head"]
        return counts
    fixed = _first_last(split) or {}
    rest = num_blocks - sum(fixed.values())
    others = num_chunks - len(fixed)
    if rest < 0:
        raise ConfigError(f"{shown} puts {sum(fixed.values())} repeated blocks on the end chunks, more than the "
                          f"model's {num_blocks}; change the counts or use 'uniform' or 'balanced'")
    if (others and rest % others) or (not others and rest):
        raise ConfigError(f"{shown} leaves {rest} of the {num_blocks} repeated blocks for the other {others} of "
                          f"{num_chunks} model chunks, which does not split evenly; change the counts or use "
                          "'uniform' or 'balanced'")
    even = rest // others if others else 0
    return [fixed.get("first", even)] + [even] * (num_chunks - 2) + [fixed.get("last", even)]


def split_spans(is_block: Sequence[bool], num_chunks: int, split: str) -> list[StageSpan]:
    """The model chunks of a split by count as spans of segments (`is_block`: whether each segment
    is a repeated block). Segments before the first block go with the first chunk, those after
    the last block with the last, others with the block before them."""
    counts = split_counts(sum(is_block), num_chunks, split)
    chunk_of_block = [chunk for chunk, count in enumerate(counts) for _ in range(count)]
    last_block = max((position for position, block in enumerate(is_block) if block), default=-1)
    blocks_seen, chunks = 0, []
    for position, block in enumerate(is_block):
        if block:
            chunks.append(chunk_of_block[blocks_seen])
            blocks_seen += 1
        else:
            chunks.append(0 if blocks_seen == 0 else num_chunks - 1 if position > last_block else chunks[-1])
    starts: dict[int, int] = {}
    stops: dict[int, int] = {}
    for position, chunk in enumerate(chunks):
        starts.setdefault(chunk, position)
        stops[chunk] = position + 1
    if len(starts) < num_chunks:
        empty = [chunk for chunk in range(num_chunks) if chunk not in starts]
        raise ConfigError(f"pipeline_split '{split}' leaves model chunk(s) {empty} of {num_chunks} empty (no block, "
                          "no embedding or head): give each chunk at least one block")
    return [StageSpan(starts[chunk], stops[chunk]) for chunk in range(num_chunks)]


def block_flags(segments) -> tuple[bool, ...]:
    """Whether each segment (graph.Segment) is one instance of a repeated block."""
    return tuple(segment.block_group is not None for segment in segments)


def split_blocker(is_block: Sequence[bool], num_chunks: int, split: str) -> str:
    """Why the split cannot cut these segments into `num_chunks` chunks ("" when it can)."""
    if split == BALANCED:
        return "" if num_chunks <= len(is_block) else f"{num_chunks} chunks need at least as many segments"
    try:
        split_spans(is_block, num_chunks, split)
    except ConfigError as error:
        return str(error)
    return ""


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

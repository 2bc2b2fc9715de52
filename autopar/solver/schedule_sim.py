"""Lays out a pipeline schedule's pass order on identical stages and returns its bubble.

Every rank runs its order (schedules.py) as early as the dependencies allow: a forward waits
for the previous stage's forward of the same microbatch, a backward for the next stage's
backward (the last stage: its own forward), a weight-gradient pass for its own backward. The
step model uses this where a schedule's bubble has no closed form (ZB-V once F, B and W differ);
timeline.py lays out whole plans the same way, with each stage's own times.

The bubble is the makespan minus m (F + B + W) of one stage. It scales with the pass times, so
layouts are cached by the passes' shares of a stage's time (to 1e-6); the dependency graph of
an order is built once and walked in a topological order for each set of durations.
"""

from __future__ import annotations

from functools import lru_cache

from autopar.solver.pipeline import stage_of
from autopar.solver.schedules import SPLIT_BACKWARD, rank_order


def uniform_bubble_s(schedule: str, *, num_ranks: int, num_microbatches: int, num_chunks: int, forward_s: float,
                     backward_s: float, weight_s: float) -> float:
    """Idle time of one step's pipeline whose every chunk's passes last forward_s (F),
    backward_s (B: the input gradient under split schedules) and weight_s (W)."""
    total = forward_s + backward_s + weight_s
    if total <= 0 or num_ranks <= 1:
        return 0.0
    count = num_microbatches
    if schedule == "zbv":
        count = min(num_microbatches, 2 * num_ranks - 1)  # its bubble stops growing there
    shares = (round(forward_s / total, 6), round(backward_s / total, 6))
    makespan = _makespan(schedule, num_ranks, count, num_chunks, shares)
    steady = count * num_chunks
    return max(0.0, makespan - steady) * total


@lru_cache(maxsize=4096)
def _makespan(schedule: str, num_ranks: int, num_microbatches: int, num_chunks: int,
              shares: tuple[float, float]) -> float:
    """Makespan in units of one chunk's F + B + W."""
    forward, backward = shares
    weight = max(0.0, 1.0 - forward - backward)
    split = schedule in SPLIT_BACKWARD
    seconds = (forward, backward if split else backward + weight, weight)
    kinds, before, needs = _dependency_graph(schedule, num_ranks, num_microbatches, num_chunks)[1:]
    finish = [0.0] * len(kinds)
    for index, kind in enumerate(kinds):  # the loop of lay_out with durations by kind
        previous, need = before[index], needs[index]
        start = finish[previous] if previous >= 0 else 0.0
        if need >= 0 and finish[need] > start:
            start = finish[need]
        finish[index] = start + seconds[kind]
    return max(finish)


def layout_makespan(schedule: str, num_ranks: int, num_microbatches: int, num_chunks: int, duration) -> float:
    """Makespan of the order with `duration(rank, kind, chunk)` per pass."""
    return lay_out(schedule, num_ranks, num_microbatches, num_chunks,
                   lambda rank, kind, chunk, microbatch, start_s: start_s + duration(rank, kind, chunk))


def lay_out(schedule: str, num_ranks: int, num_microbatches: int, num_chunks: int, run) -> float:
    """Run every rank's pass order as early as its dependencies allow (list scheduling):
    `run(rank, kind, chunk, microbatch, start_s)` returns when that pass ends. The makespan."""
    passes, _, before, needs = _dependency_graph(schedule, num_ranks, num_microbatches, num_chunks)
    finish = [0.0] * len(passes)
    for index, (rank, kind, chunk, microbatch) in enumerate(passes):
        previous, need = before[index], needs[index]
        start = finish[previous] if previous >= 0 else 0.0
        if need >= 0:
            start = max(start, finish[need])
        finish[index] = run(rank, kind, chunk, microbatch, start)
    return max(finish, default=0.0)


_KINDS = {"F": 0, "B": 1, "W": 2}


@lru_cache(maxsize=256)
def _dependency_graph(schedule: str, num_ranks: int, num_microbatches: int, num_chunks: int):
    """Every rank's passes in an order that respects their dependencies: (passes as (rank,
    kind, chunk, microbatch), kind index per pass (F 0, B 1, W 2), the index of the same rank's
    previous pass, the index of the pass it waits for; -1 for none). A forward waits for the
    previous stage's forward of its microbatch, a backward for the next stage's backward (the
    last stage: its own forward), a weight-gradient pass for its own backward. A pass starts
    when both have ended, so its start is the longest path to it whatever the durations: the
    graph is built once per order (Kahn's algorithm) and walked for each set of durations."""
    last_stage = num_ranks * num_chunks - 1
    passes: list[tuple[int, str, int, int]] = []
    keys: list[tuple[str, int, int]] = []
    waits: list[tuple[str, int, int] | None] = []
    before: list[int] = []
    for rank in range(num_ranks):
        order = rank_order(schedule, rank=rank, num_ranks=num_ranks, num_microbatches=num_microbatches,
                           num_chunks=num_chunks)
        for position, (kind, chunk, microbatch) in enumerate(order):
            stage = stage_of(schedule, rank=rank, chunk=chunk, num_ranks=num_ranks)
            if kind == "F":
                needs = ("F", stage - 1, microbatch) if stage > 0 else None
            elif kind == "B":
                needs = ("B", stage + 1, microbatch) if stage < last_stage else ("F", stage, microbatch)
            else:
                needs = ("B", stage, microbatch)
            before.append(len(passes) - 1 if position else -1)
            passes.append((rank, kind, chunk, microbatch))
            keys.append((kind, stage, microbatch))
            waits.append(needs)
    index_of = {key: index for index, key in enumerate(keys)}
    needs_index = [-1 if needs is None else index_of.get(needs, -2) for needs in waits]
    # Kahn's algorithm; a pass left unplaced waits on a cycle (or on a pass no rank runs).
    children: list[list[int]] = [[] for _ in passes]
    pending = [0] * len(passes)
    for index, (previous, need) in enumerate(zip(before, needs_index)):
        for parent in (previous, need):
            if parent >= 0:
                children[parent].append(index)
                pending[index] += 1
            elif parent == -2:
                pending[index] += 1
    order = [index for index, count in enumerate(pending) if count == 0]
    for index in order:  # grows while walked
        for child in children[index]:
            pending[child] -= 1
            if pending[child] == 0:
                order.append(child)
    if len(order) < len(passes):
        raise RuntimeError(f"the {schedule} order deadlocks with {num_ranks} ranks, {num_microbatches} "
                           f"microbatches and {num_chunks} chunks (a bug in autopar/solver/schedules.py)")
    position_of = {index: new for new, index in enumerate(order)}
    renumber = lambda index: position_of[index] if index >= 0 else -1  # noqa: E731
    return (tuple(passes[i] for i in order), tuple(_KINDS[passes[i][1]] for i in order),
            tuple(renumber(before[i]) for i in order), tuple(renumber(needs_index[i]) for i in order))

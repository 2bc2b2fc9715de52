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
    graph is built once per order (ranks swept in turn, each running the passes whose dependency
    has run) and walked for each set of durations."""
    num_stages = num_ranks * num_chunks
    last_stage = num_stages - 1
    orders = [rank_order(schedule, rank=rank, num_ranks=num_ranks, num_microbatches=num_microbatches,
                         num_chunks=num_chunks) for rank in range(num_ranks)]
    # Passes are keyed (kind, stage, microbatch) -> (kind * stages + stage) * m + microbatch (an
    # order may name microbatches beyond num_microbatches: m counts them all).
    m = 1 + max((step[2] for order in orders for step in order), default=0)
    f_base, b_base, w_base = 0, num_stages * m, 2 * num_stages * m
    passes: list[tuple[int, str, int, int]] = []
    keys: list[int] = []
    waits: list[int] = []
    for rank, order in enumerate(orders):
        stages = [stage_of(schedule, rank=rank, chunk=chunk, num_ranks=num_ranks) for chunk in range(num_chunks)]
        for kind, chunk, microbatch in order:
            stage = stages[chunk]
            here = stage * m + microbatch
            if kind == "F":
                keys.append(f_base + here)
                waits.append(here - m if stage > 0 else -1)
            elif kind == "B":
                keys.append(b_base + here)
                waits.append(b_base + here + m if stage < last_stage else f_base + here)
            else:
                keys.append(w_base + here)
                waits.append(b_base + here)
            passes.append((rank, kind, chunk, microbatch))
    index_of = [-2] * (3 * num_stages * m)
    for index, key in enumerate(keys):
        index_of[key] = index
    needs_index = [-1 if key < 0 else index_of[key] for key in waits]
    starts = [0] * (num_ranks + 1)
    for rank, order in enumerate(orders):
        starts[rank + 1] = starts[rank] + len(order)
    ran = _sweep(starts, needs_index)
    if ran is None:
        raise RuntimeError(f"the {schedule} order deadlocks with {num_ranks} ranks, {num_microbatches} "
                           f"microbatches and {num_chunks} chunks (a bug in autopar/solver/schedules.py)")
    firsts = set(starts)
    before = [-1 if index in firsts else index - 1 for index in range(len(passes))]
    position_of = [0] * len(passes)
    for new, index in enumerate(ran):
        position_of[index] = new
    renumber = lambda index: position_of[index] if index >= 0 else -1  # noqa: E731
    return (tuple(passes[i] for i in ran), tuple(_KINDS[passes[i][1]] for i in ran),
            tuple(renumber(before[i]) for i in ran), tuple(renumber(needs_index[i]) for i in ran))


def _sweep(starts: list[int], needs_index: list[int]) -> list[int] | None:
    """A topological order of the passes (rank r's are starts[r]..starts[r+1]-1, in its order):
    sweep the ranks, each running its passes while what they wait for has run. None when a sweep
    runs nothing: a cycle, or a pass waiting on one no rank runs (-2)."""
    num_ranks = len(starts) - 1
    next_of, done = starts[:-1], [False] * starts[-1]
    ran: list[int] = []
    while len(ran) < starts[-1]:
        progressed = False
        for rank in range(num_ranks):
            index, stop = next_of[rank], starts[rank + 1]
            while index < stop:
                need = needs_index[index]
                if need == -2 or (need >= 0 and not done[need]):
                    break
                done[index] = True
                ran.append(index)
                index += 1
            if index != next_of[rank]:
                next_of[rank], progressed = index, True
        if not progressed:
            return None
    return ran

"""The order in which one pipeline rank runs its forward and backward passes, as the schedules of
torch.distributed.pipelining run them (the codegen uses those schedules):

    GPipe         every forward (microbatch 0 .. m-1), then every backward
    1F1B          min(m, p - rank) forwards, then alternately one backward and one forward,
                  then the remaining backwards (rank k holds at most p - k microbatches)
    interleaved   v model chunks per rank; forwards go round by round (p microbatches per
                  round) through chunks 0 .. v-1, backwards through chunks v-1 .. 0; the warmup
                  is (v - 1) p + 2 (p - 1 - rank) forwards, capped at m v, then one forward and
                  one backward alternate (Narayanan et al., SC21, section 2.2)
    zb1p          ScheduleInterleavedZeroBubble (ZB-1P of Qi et al., "Zero Bubble Pipeline
                  Parallelism", 2023): the interleaved order with a warmup of (v - 1) p +
                  (p - 1 - rank) forwards and the backward split in two, the input gradient (B,
                  sent back at once) and the weight gradient (W); rank k defers its first k W
                  passes and runs each deferred one after the next B, the rest after the pipeline
    zbv           ScheduleZBVZeroBubble (ZB-V, same paper, section 6): two chunks per rank in a
                  V (rank k holds stages k and 2p - 1 - k); 2 (p - k) - 1 forwards of chunk 0,
                  k pairs of forwards (chunk 1, chunk 0), p - k rounds of F B W on chunk 1, then
                  F B W on chunk 0 and on chunk 1 alternately, and a drain whose W passes fill
                  the tail

Each step is (pass, local chunk, microbatch) with pass "F", "B" (the whole backward, or the
input gradient under the zero-bubble schedules) or "W" (weight gradient; zero-bubble only).
"""

from __future__ import annotations

Step = tuple[str, int, int]

SPLIT_BACKWARD = ("zb1p", "zbv")
"""Schedules that run the weight gradient as its own pass."""


def rank_order(schedule: str, *, rank: int, num_ranks: int, num_microbatches: int,
               num_chunks: int = 1) -> list[Step]:
    """The passes `rank` runs in one step, in order."""
    m, p = num_microbatches, num_ranks
    if schedule == "gpipe":
        return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]
    if schedule == "zbv":
        return _zbv(rank, p, m)
    if schedule == "zb1p":
        return _interleaved(rank, p, m, num_chunks, zero_bubble=True)
    if schedule == "interleaved" and num_chunks > 1:
        return _interleaved(rank, p, m, num_chunks)
    # 1F1B, and a single device accumulating gradients (p = 1: forward, backward, forward ...).
    warmup = min(m, p - rank)
    order: list[Step] = [("F", 0, j) for j in range(warmup)]
    for j in range(m):
        order.append(("B", 0, j))
        if warmup + j < m:
            order.append(("F", 0, warmup + j))
    return order


def _interleaved(rank: int, p: int, m: int, v: int, *, zero_bubble: bool = False) -> list[Step]:
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    seen = {"F": [0] * v, "B": [0] * v, "W": [0] * v}
    backward_chunks: list[int] = []

    def step(kind: str, chunk: int) -> Step:
        seen[kind][chunk] += 1
        return (kind, chunk, seen[kind][chunk] - 1)

    def forward(op: int) -> Step:
        return step("F", (op // per_round) % v)

    def backward(op: int) -> Step:
        chunk = v - 1 - ((op - warmup) // per_round) % v
        backward_chunks.append(chunk)
        return step("B", chunk)

    def weight_after(op: int) -> list[Step]:
        # Rank k keeps its first k weight gradients for later (torch's num_1f1b_microbatches).
        if not zero_bubble or op - warmup < rank:
            return []
        return [step("W", backward_chunks[sum(seen["W"])])]

    order = [forward(op) for op in range(warmup)]
    for op in range(warmup, total):
        order += [forward(op), backward(op)] + weight_after(op)
    for op in range(total, total + warmup):
        order += [backward(op)] + weight_after(op)
    while zero_bubble and sum(seen["W"]) < len(backward_chunks):
        order.append(step("W", backward_chunks[sum(seen["W"])]))
    return order


def _zbv(rank: int, p: int, m: int) -> list[Step]:
    """torch's ZB-V order; it is laid out for at least 2p - 1 microbatches and drops the passes
    of the microbatches that do not exist."""
    count = max(2 * p - 1, m)
    order: list[Step] = []
    next_of = {(kind, chunk): 0 for kind in "FBW" for chunk in (0, 1)}

    def run(kind: str, chunk: int, microbatch: int | None = None) -> None:
        index = next_of[(kind, chunk)] if microbatch is None else microbatch
        if microbatch is None:
            next_of[(kind, chunk)] += 1
        order.append((kind, chunk, index))

    for _ in range(2 * (p - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(p - rank):
        run("F", 1)
        run("B", 1)
        run("W", 1)
    while next_of[("F", 1)] < next_of[("F", 0)] or next_of[("F", 0)] < count:
        if next_of[("F", 0)] < count:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        run("F", 1)
        run("B", 1)
        run("W", 1)
    for _ in range(rank):
        run("B", 0)
        run("B", 1)
    for _ in range(p - rank):
        run("B", 0)
        run("W", 0)
    while next_of[("W", 1)] < next_of[("B", 1)]:
        run("W", 1)
    while next_of[("W", 0)] < next_of[("B", 0)]:
        run("W", 0)
    return [step for step in order if step[2] < m]

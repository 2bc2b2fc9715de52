"""The order in which one pipeline rank runs its forward and backward passes, as the schedules of
torch.distributed.pipelining run them (the codegen uses those schedules):

    GPipe         every forward (microbatch 0 .. m-1), then every backward
    1F1B          min(m, p - rank) forwards, then alternately one backward and one forward,
                  then the remaining backwards (rank k holds at most p - k microbatches)
    interleaved   v model chunks per rank; forwards go round by round (p microbatches per
                  round) through chunks 0 .. v-1, backwards through chunks v-1 .. 0; the warmup
                  is (v - 1) p + 2 (p - 1 - rank) forwards, capped at m v, then one forward and
                  one backward alternate (Narayanan et al., SC21, section 2.2)

Each step is (pass, local chunk, microbatch) with pass "F" or "B".
"""

from __future__ import annotations

Step = tuple[str, int, int]


def rank_order(schedule: str, *, rank: int, num_ranks: int, num_microbatches: int,
               num_chunks: int = 1) -> list[Step]:
    """The passes `rank` runs in one step, in order."""
    m, p = num_microbatches, num_ranks
    if schedule == "gpipe":
        return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]
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


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Step]:
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    forward_seen = [0] * v
    backward_seen = [0] * v

    def forward(op: int) -> Step:
        chunk = (op // per_round) % v
        forward_seen[chunk] += 1
        return ("F", chunk, forward_seen[chunk] - 1)

    def backward(op: int) -> Step:
        chunk = v - 1 - ((op - warmup) // per_round) % v
        backward_seen[chunk] += 1
        return ("B", chunk, backward_seen[chunk] - 1)

    order = [forward(op) for op in range(warmup)]
    for op in range(warmup, total):
        order += [forward(op), backward(op)]
    order += [backward(op) for op in range(total, total + warmup)]
    return order

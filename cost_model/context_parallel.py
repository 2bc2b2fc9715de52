"""Context parallelism: attention over a sequence split across `cp` ranks.

Every rank holds `seq / cp` tokens of each sequence for the whole block; attention is the one op
that mixes positions, so each rank needs every other rank's keys and values. Two ways to move
them, both priced here per attention op and per microbatch:

- all-gather KV (what Llama 3's long-context training ran, Dubey et al. 2024, sec. 3.3.2): one
  all-gather of K and V over the cp group before the op (its backward: one reduce-scatter of dK,
  dV). With grouped-query attention K and V are small (8 KV heads against 128 query heads).
- ring (Liu et al. 2023, ring attention; torch's `context_parallel`): cp - 1 steps, each sending
  the KV block on to the next rank while the current block is attended (the backward also
  passes dKV, twice the bytes).

Overlap: the block a rank already holds (its own keys and values) is attended while the
collective is in flight, and a ring step overlaps the next block's transfer with the current
block's attention, so what is exposed is what the communication takes beyond that compute:
    all-gather   exposed = max(0, t_gather - A / cp)
    ring         exposed = (cp - 1) x max(0, t_step - A / cp)
with A the rank's attention time (forward, or backward with the reduce-scatter / dKV).

Load balance of causal attention: with the sequence cut into 2 cp chunks and rank i holding
chunks i and 2 cp - 1 - i (Megatron-LM's and torch's load balancer), every rank does exactly
1 / cp of the causal work; with contiguous chunks rank cp - 1 does (2 cp - 1) / cp^2 of it.
"""

from __future__ import annotations

KV_METHODS = ("all_gather", "ring")


def causal_work_share(num_ranks: int, *, load_balanced: bool) -> float:
    """Share of a causal attention's work done by the busiest of `num_ranks` ranks."""
    if num_ranks <= 1:
        return 1.0
    if load_balanced:
        return 1.0 / num_ranks
    return (2 * num_ranks - 1) / num_ranks ** 2


def exposed_kv_exchange_s(*, method: str, collective_s: float, attention_s: float, num_ranks: int) -> float:
    """Exposed time of one attention op's KV exchange.

    `collective_s`: the whole all-gather (or reduce-scatter) for "all_gather", one step's
    send/recv for "ring"; `attention_s`: the rank's whole attention time in that pass."""
    if num_ranks <= 1:
        return 0.0
    if method not in KV_METHODS:
        raise ValueError(f"unknown KV exchange '{method}'; known: {', '.join(KV_METHODS)}")
    per_block_s = attention_s / num_ranks
    if method == "all_gather":
        return max(0.0, collective_s - per_block_s)
    return (num_ranks - 1) * max(0.0, collective_s - per_block_s)


def ring_step_bytes(kv_bytes: float, num_ranks: int, *, backward: bool) -> float:
    """Bytes one ring step sends: this rank's KV block (plus its dKV in the backward)."""
    return kv_bytes / num_ranks * (2 if backward else 1)

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

torch's `context_parallel` as it runs ("torch", "torch_compiled": what torchtitan runs; torch
/distributed/tensor/experimental/_attention.py from 2024-12 on, `_templated_ring_attention` and
its backward), on each rank holding 2 chunks of c = seq / (2 cp) tokens, load-balanced:
- the K and V it moves are the ones SDPA is given: every query head's when the model repeats its
  kv heads before SDPA (torchtitan's Llama does, `repeat_kv`), not the kv heads alone;
- forward: cp SDPA calls, step 0 causal over the local 2c x 2c block (1 / cp^2 of torch's count),
  then cp - 1 non-causal calls of c x 2c (half the queries against a whole block, or all of them
  against its first chunk), priced at the kernel's non-causal rate; keys and values come from one
  all-gather of the whole group's K, V (the default rotate method, `_RotateMethod.ALL_GATHER`;
  torchtitan's `context_parallel_rotate_method` default "allgather"), issued before step 0;
  each step's output is merged into an fp32 output with the logsumexps (`_SDPAMerger`,
  `convert_to_f32=True`): element-wise passes over the local output per step;
- backward: the K, V all-gather again, cp flash backward calls of the same shapes, dQ, dK, dV
  accumulated in fp32, and the fp32 dK, dV passed to the next rank after every step (an
  all-to-all permute, `_RotateMethod.ALL_TO_ALL` whatever the rotate method): cp sends of twice
  the local K, V bytes;
- when the attention is compiled (torchtitan compiles each block, `fullgraph=True`), the traced
  collectives are waited where they are issued (`_functional_collectives._maybe_wrap_tensor`:
  "if _are_we_tracing(): return wait_tensor(self)") and Inductor moves no wait
  (`reorder_for_compute_comm_overlap` is off by default): every exchange is exposed. Eager, the
  all-gather overlaps step 0 and each dK, dV send the next step's backward; the last one waits.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_METHODS = ("all_gather", "ring", "torch", "torch_compiled")
TORCH_METHODS = ("torch", "torch_compiled")
"""torch's `context_parallel` as it runs, eager or with the attention compiled (module docstring)."""


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


@dataclass(frozen=True, kw_only=True)
class RingStep:
    """One SDPA call of torch's ring on one rank: its share of torch's FLOP count of the whole
    attention and whether it runs causal."""

    flops_fraction: float
    causal: bool


def torch_ring_steps(num_ranks: int, *, causal: bool) -> tuple[RingStep, ...]:
    """The SDPA calls of one rank, forward (the backward makes the same calls): load-balanced
    causal attention makes the causal diagonal block and cp - 1 non-causal c x 2c blocks; without
    a causal mask every step is a whole non-causal block."""
    if num_ranks <= 1:
        return (RingStep(flops_fraction=1.0, causal=causal),)
    block = 1.0 / num_ranks**2
    if not causal:
        return tuple(RingStep(flops_fraction=block, causal=False) for _ in range(num_ranks))
    return (RingStep(flops_fraction=block, causal=True),) + tuple(
        RingStep(flops_fraction=block / 2, causal=False) for _ in range(num_ranks - 1))


TORCH_MERGE_BYTES_PER_ELEMENT = {"torch": 38.0, "torch_compiled": 10.0}
"""Bytes a forward merge step moves per element of the local output. Eager (`_SDPAMerger.step` on
the busiest rank, whose steps all merge the whole output): the block output cast to fp32 (2 + 4),
out - block_out (4 + 4 + 4), sigmoid(lse difference) x that (4 + 4), out - it (4 + 4 + 4).
Compiled, Inductor fuses the merge into one pass: the fp32 output and the bf16 block output read,
the fp32 output written (4 + 2 + 4)."""

TORCH_BACKWARD_BYTES_PER_ELEMENT = {"torch": (10.0, 25.0), "torch_compiled": (10.0, 14.0)}
"""Bytes one backward step moves per element of the local (queries, keys + values). Eager:
dQ += its bf16 block (4 + 2 + 4); dK, dV added into their first chunk and concatenated back
(`_partial_update`: 5 + 8), the fp32 dK, dV concatenated to send (4 + 4), K and V concatenated
to send (2 + 2). Compiled: each accumulation one pass written into the send buffer (4 + 2 + 4),
K, V concatenated (2 + 2)."""


def torch_gather_exposed_s(*, method: str, gather_s: float, diagonal_s: float) -> float:
    """Exposed time of a K, V all-gather (forward or backward): all of it compiled, beyond the
    diagonal block's attention (forward or backward) eager."""
    return gather_s if method == "torch_compiled" else max(0.0, gather_s - diagonal_s)


def torch_dkv_sends_exposed_s(*, method: str, send_s: float, step_s: float, num_ranks: int) -> float:
    """Exposed time of the backward's cp sends of fp32 dK, dV: all of them compiled; eager each
    beyond the next step's backward, and the last one whole."""
    if method == "torch_compiled":
        return num_ranks * send_s
    return (num_ranks - 1) * max(0.0, send_s - step_s) + send_s

"""FSDP2 (ZeRO over the data-parallel group) as it runs: per-unit all-gathers and
reduce-scatters on one communication stream, overlapped with the compute of other units.

Every FSDP unit (a transformer block, the embedding, the head) gathers its parameters before
its forward and, when resharded after forward (ZeRO-3, `reshard_after_forward=True`), again
before its backward; its gradients are reduce-scattered right after its backward, in the reduce
dtype. FSDP2 keeps at most one unit gathered ahead (forward: the next unit's all-gather is
issued when a unit starts; backward: the previous unit's, in reverse order), and NCCL kernels of
the all-gather and the reduce-scatter streams share the same links, so they are priced as one
serial communication queue. The compute stream waits for a unit's all-gather; the optimizer
waits for the last reduce-scatter. For one microbatch, with units 0..n-1, forward times F_i,
backward times B_i, gather times G_i and reduce-scatter times R_i:

    forward     unit i starts at max(end of unit i-1, gather i done); gather i+1 is queued when
                unit i starts (gather 0 is exposed: nothing precedes it)
    backward    units n-1..0; gather i-1 is queued when unit i starts (if resharded), the
                reduce-scatter of unit i when it ends; the step waits for the queue to drain
    exposed     (forward end - sum F) + (backward end - forward end - sum B)

Without resharding after forward (ZeRO-1/2 as FSDP2 runs them) the backward needs no gathers.

**Root ends** (`root_ends`): torchtitan calls `fully_shard` on every transformer block and then on
the whole model, so the embedding, the final norm and the output head are one unit, the root's
(pytorch/torchtitan parallelize_llama's apply_fsdp). FSDP2 never reshards the root after forward
("For the root, do not reshard after forward since for training, the parameters would be freed
and all-gathered immediately": FSDPState._lazy_init), and the root's gradients are reduce-
scattered together once its last parameter's gradient exists, the embedding's at the end of the
backward. torchtitan also keeps the last block gathered (`reshard_after_forward = layer_id <
len(layers) - 1`). So the first and last units are gathered together before the first forward
(exposed), neither they nor the last block is gathered again for backward, and the first and
last units' gradients are reduce-scattered together after the whole backward (exposed).

autopar's runtime wraps a stage that way where the ends are small (`ends_fit_a_block`): the first
and last segments together hold no more parameters than the largest block between them, so the
root holds at most one block's more. Each FSDP unit costs the host its hooks and collective calls
in every microbatch (benchmarks/runtime_overhead.py: two units more cost a 4-layer GPT's step about
3% of its CPU time); where the ends are large (an untied embedding and head of a 128k vocabulary)
they stay units of their own, as torchtitan wraps them since 2025-07, and are not held gathered.
No torch and no autopar imports here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FsdpUnit:
    """One FSDP unit of a pipeline stage, for one microbatch on one device."""

    forward_s: float
    """Compute (and tensor-parallel communication) of the unit's forward."""
    backward_s: float
    """Its backward, with any recomputation."""
    all_gather_s: float
    """Gathering its parameters over the data-parallel group."""
    reduce_scatter_s: float
    """Reduce-scattering its gradients (in the reduce dtype) over the data-parallel group."""


@dataclass(frozen=True, kw_only=True)
class FsdpTimeline:
    """Where one microbatch's FSDP communication is exposed."""

    forward_gather_exposed_s: float
    """Forward time added by waiting for all-gathers (the first unit's is always exposed)."""
    backward_exposed_s: float
    """Backward time added by waiting for all-gathers and, at the end, the reduce-scatters."""
    first_gather_s: float
    """All-gather of the first unit, which nothing hides."""
    last_reduce_scatter_s: float
    """Reduce-scatter of the last unit run in backward (unit 0), which only the step end waits for."""
    gather_s: float
    """All-gathers in all (forward and, if resharded, backward)."""
    reduce_scatter_s: float
    """Reduce-scatters in all."""
    compute_s: float
    """Forward + backward compute the communication can hide behind."""
    worst_unit_ratio: float
    """Largest (gather + reduce-scatter) / (forward + backward) over the units: above 1 a unit's
    communication cannot hide behind its neighbour's compute."""
    root_ends: bool = False
    """The first and last units are the root's ("root ends"; set by the caller that chose it)."""

    @property
    def exposed_s(self) -> float:
        return self.forward_gather_exposed_s + self.backward_exposed_s

    @property
    def hidden_fraction(self) -> float:
        total = self.gather_s + self.reduce_scatter_s
        return 1.0 - self.exposed_s / total if total > 0 else 1.0


def fsdp_timeline(units: Sequence[FsdpUnit], *, reshard_after_forward: bool,
                  reduce_scatter: bool = True) -> FsdpTimeline:
    """Simulates one microbatch's forward and backward (module docstring)."""
    return timeline_of_arrays([unit.forward_s for unit in units], [unit.backward_s for unit in units],
                              [unit.all_gather_s for unit in units], [unit.reduce_scatter_s for unit in units],
                              reshard_after_forward=reshard_after_forward, reduce_scatter=reduce_scatter)


def timeline_of_arrays(forward_s: list[float], backward_s: list[float], gather_s: list[float],
                       scatter_s: list[float], *, reshard_after_forward: bool,
                       reduce_scatter: bool = True) -> FsdpTimeline:
    """`fsdp_timeline` on per-unit lists (the planner's fast path: no objects per unit)."""
    return timelines_of_arrays(forward_s, backward_s, gather_s, scatter_s, reshard_after_forward=reshard_after_forward,
                               reduce_scatter=reduce_scatter)[0]


def timelines_of_arrays(forward_s: list[float], backward_s: list[float], gather_s: list[float],
                        scatter_s: list[float], *, reshard_after_forward: bool, reduce_scatter: bool = True,
                        backward_gather_s: list[float] | None = None) -> tuple[FsdpTimeline, float]:
    """(the timeline, and what would be exposed without any reduce-scatter), in one forward pass.
    `backward_gather_s`: each unit's gather before its backward where it differs from its forward
    one (`root_ends`); None: the same."""
    if not forward_s:
        return FsdpTimeline(forward_gather_exposed_s=0.0, backward_exposed_s=0.0, first_gather_s=0.0,
                            last_reduce_scatter_s=0.0, gather_s=0.0, reduce_scatter_s=0.0, compute_s=0.0,
                            worst_unit_ratio=0.0), 0.0
    scatters = scatter_s if reduce_scatter else [0.0] * len(scatter_s)
    regather_s = gather_s if backward_gather_s is None else backward_gather_s
    forward_end, queue_free = _forward(forward_s, gather_s)
    backward_end = _backward(backward_s, regather_s, scatters, forward_end, queue_free, reshard_after_forward)
    forward_compute, backward_compute = sum(forward_s), sum(backward_s)
    forward_exposed = max(0.0, forward_end - forward_compute)
    gathers_only = forward_exposed
    if reduce_scatter:
        no_scatter = _backward(backward_s, regather_s, [0.0] * len(gather_s), forward_end, queue_free,
                               reshard_after_forward)
        gathers_only += max(0.0, no_scatter - forward_end - backward_compute)
    regathers = regather_s if reshard_after_forward else [0.0] * len(gather_s)
    ratios = [(gather + regather + scatter) / max(forward + backward, 1e-30)
              for forward, backward, gather, regather, scatter
              in zip(forward_s, backward_s, gather_s, regathers, scatters) if gather + regather > 0]
    timeline = FsdpTimeline(forward_gather_exposed_s=forward_exposed,
                            backward_exposed_s=max(0.0, backward_end - forward_end - backward_compute),
                            first_gather_s=gather_s[0], last_reduce_scatter_s=scatters[0],
                            gather_s=sum(gather_s) + sum(regathers), reduce_scatter_s=sum(scatters),
                            compute_s=forward_compute + backward_compute, worst_unit_ratio=max(ratios, default=0.0))
    return timeline, (gathers_only if reduce_scatter else timeline.exposed_s)


def _forward(forward_s: list[float], gather_s: list[float]) -> tuple[float, float]:
    """(end of the last unit's forward, time the communication queue is free)."""
    count = len(forward_s)
    gathered = [0.0] * count
    gathered[0] = queue = gather_s[0]
    clock = 0.0
    for index in range(count):
        start = clock if clock > gathered[index] else gathered[index]
        if index + 1 < count:  # prefetch: the next unit's gather is queued as this one starts
            queue = (queue if queue > start else start) + gather_s[index + 1]
            gathered[index + 1] = queue
        clock = start + forward_s[index]
    return clock, queue


def _backward(backward_s: list[float], gather_s: list[float], scatter_s: list[float], clock: float, queue: float,
              reshard: bool) -> float:
    """End of the backward, when the last reduce-scatter is done."""
    last = len(backward_s) - 1
    gathered = [clock] * len(backward_s)
    if reshard:
        queue = max(queue, clock) + gather_s[last]
        gathered[last] = queue
    for index in range(last, -1, -1):
        start = clock if clock > gathered[index] else gathered[index]
        if reshard and index > 0:
            queue = (queue if queue > start else start) + gather_s[index - 1]
            gathered[index - 1] = queue
        clock = start + backward_s[index]
        if scatter_s[index]:
            queue = (queue if queue > clock else clock) + scatter_s[index]
    return max(clock, queue)


def root_ends(gather_s: list[float], scatter_s: list[float]) -> tuple[list[float], list[float], list[float]]:
    """(forward gathers, backward gathers, reduce-scatters) per unit when the first and last units
    are the root unit and the last block stays gathered (module docstring), from each unit's own
    gather and reduce-scatter times: the root's collectives are one each, at unit 0 (first in
    forward, last in backward), priced as the sum of the two units' own (one collective's latency
    over). Fewer than three units: as they are."""
    if len(gather_s) < 3:
        return list(gather_s), list(gather_s), list(scatter_s)
    forward = [gather_s[0] + gather_s[-1], *gather_s[1:-1], 0.0]
    backward = [0.0, *gather_s[1:-2], 0.0, 0.0]
    scatters = [scatter_s[0] + scatter_s[-1], *scatter_s[1:-1], 0.0]
    return forward, backward, scatters


def ends_fit_a_block(unit_param_numel: Sequence[float]) -> bool:
    """Whether the first and last of a stage's units (three or more) together hold no more
    parameters than the largest unit between them: the runtime makes them the root's (module
    docstring, "root ends")."""
    sizes = list(unit_param_numel)
    return len(sizes) >= 3 and sizes[0] + sizes[-1] <= max(sizes[1:-1])


def copy_bytes(numel: float, *, gather_bytes: float, reduce_bytes: float) -> tuple[float, float]:
    """(all-gather copy-out, reduce-scatter copy-in) memory traffic in bytes for a unit of `numel`
    unsharded parameters: copies FSDP2 makes on the compute stream, besides the collectives.

    After each all-gather, `foreach_all_gather_copy_out` splits the gathered flat buffer (laid
    out rank by rank) into the unsharded parameters: it reads and writes every element in the
    gathered dtype. Before each reduce-scatter, `foreach_reduce_scatter_copy_in` packs the
    unsharded gradients (in the unsharded parameters' dtype) rank-major into one buffer of the
    reduce dtype: it reads each gradient and writes it in the reduce dtype (an fp32 reduce of
    bf16 gradients writes twice what it reads). Since torch 2.5 both run on the current (compute)
    stream; the all-gather copy-in of the local shard (1/dp of the unit) runs on the gather's
    stream and is left out."""
    return 2.0 * numel * gather_bytes, numel * (gather_bytes + reduce_bytes)


def unsharded_bytes(unit_param_numel: Sequence[float], *, param_bytes: float, grad_bytes: float,
                    root_ends: bool = False, held_grad_bytes: float = 0.0) -> float:
    """Peak of FSDP2's gathered buffers: the largest unit gathered with the next one prefetched
    (two consecutive units' parameters) plus one unit's unsharded gradients before its
    reduce-scatter frees them. With `root_ends` (module docstring) the first and last units'
    parameters are held besides, from the first forward to the end of the backward, and so are
    the last unit's unsharded gradients (`held_grad_bytes` each: the compute dtype), from its
    backward (the first) until the root's reduce-scatter."""
    sizes = list(unit_param_numel)
    if not sizes:
        return 0.0
    if root_ends and len(sizes) >= 3:
        middle = sizes[1:-1]
        pair = max(map(sum, zip(middle, middle[1:])), default=middle[0])
        return (sizes[0] + sizes[-1] + pair) * param_bytes + sizes[-1] * held_grad_bytes + max(middle) * grad_bytes
    pair = max(map(sum, zip(sizes, sizes[1:])), default=sizes[0])
    return pair * param_bytes + max(sizes) * grad_bytes

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
    count = len(units)
    if count == 0:
        return FsdpTimeline(forward_gather_exposed_s=0.0, backward_exposed_s=0.0, first_gather_s=0.0,
                            last_reduce_scatter_s=0.0, gather_s=0.0, reduce_scatter_s=0.0, compute_s=0.0,
                            worst_unit_ratio=0.0)
    forward_end, queue_free = _forward(units)
    backward_end = _backward(units, forward_end, queue_free, reshard_after_forward, reduce_scatter)
    forward_compute = sum(unit.forward_s for unit in units)
    backward_compute = sum(unit.backward_s for unit in units)
    gathers = sum(unit.all_gather_s for unit in units) * (2 if reshard_after_forward else 1)
    scatters = sum(unit.reduce_scatter_s for unit in units) if reduce_scatter else 0.0
    ratios = [(unit.all_gather_s * (2 if reshard_after_forward else 1) + (unit.reduce_scatter_s if reduce_scatter
                                                                           else 0.0))
              / max(unit.forward_s + unit.backward_s, 1e-30) for unit in units if unit.all_gather_s > 0]
    return FsdpTimeline(forward_gather_exposed_s=max(0.0, forward_end - forward_compute),
                        backward_exposed_s=max(0.0, backward_end - forward_end - backward_compute),
                        first_gather_s=units[0].all_gather_s,
                        last_reduce_scatter_s=units[0].reduce_scatter_s if reduce_scatter else 0.0,
                        gather_s=gathers, reduce_scatter_s=scatters, compute_s=forward_compute + backward_compute,
                        worst_unit_ratio=max(ratios, default=0.0))


def _forward(units: Sequence[FsdpUnit]) -> tuple[float, float]:
    """(end of the last unit's forward, time the communication queue is free)."""
    gathered = [0.0] * len(units)
    gathered[0] = queue = units[0].all_gather_s
    clock = 0.0
    for index, unit in enumerate(units):
        start = max(clock, gathered[index])
        if index + 1 < len(units):  # prefetch: the next unit's gather is queued as this one starts
            queue = max(queue, start) + units[index + 1].all_gather_s
            gathered[index + 1] = queue
        clock = start + unit.forward_s
    return clock, queue


def _backward(units: Sequence[FsdpUnit], clock: float, queue: float, reshard: bool, reduce_scatter: bool) -> float:
    """End of the backward, when the last reduce-scatter is done."""
    last = len(units) - 1
    gathered = [clock] * len(units)
    if reshard:
        queue = max(queue, clock) + units[last].all_gather_s
        gathered[last] = queue
    for index in range(last, -1, -1):
        start = max(clock, gathered[index])
        if reshard and index > 0:
            queue = max(queue, start) + units[index - 1].all_gather_s
            gathered[index - 1] = queue
        clock = start + units[index].backward_s
        if reduce_scatter:
            queue = max(queue, clock) + units[index].reduce_scatter_s
    return max(clock, queue)


def unsharded_bytes(unit_param_numel: Sequence[float], *, param_bytes: float, grad_bytes: float) -> float:
    """Peak of FSDP2's gathered buffers: the largest unit gathered with the next one prefetched
    (two consecutive units' parameters) plus one unit's unsharded gradients before its
    reduce-scatter frees them."""
    sizes = list(unit_param_numel)
    if not sizes:
        return 0.0
    pairs = [sizes[i] + sizes[i + 1] for i in range(len(sizes) - 1)] or [sizes[0]]
    return max(pairs) * param_bytes + max(sizes) * grad_bytes

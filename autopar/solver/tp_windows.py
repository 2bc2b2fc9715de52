"""The GEMM beside which tensor-parallel overlap can run each sequence-parallel collective.

Runtimes that overlap tensor-parallel communication with compute (Transformer Engine's
userbuffers, torch's async TP: solver/tp_overlap.py) decompose each collective into its tp ring
steps and run every step beside one chunk of one linear's GEMM: the all-gather of a linear's
input beside that linear's GEMM (the input's readers' GEMMs: q, k and v; gate and up), the
reduce-scatter of a linear's output beside the GEMM that makes it, and in backward the mirror
images (the gradient's all-gather beside the dgrad GEMM of the linear it feeds, the input
gradient's reduce-scatter beside the dgrad GEMMs that make it). A collective hides behind its
own GEMM only, not behind the step's compute at large: on a grouped-query model the attention
input's all-gather, whose q, k and v GEMMs are small, stays partly exposed while the MLP's
hides whole; float8 GEMMs, twice as fast, hide half as much.

`with_windows` records on each collective of an edge the GEMMs on its side with their forward
seconds (CommEvent.window): a dgrad GEMM does the forward's FLOPs on the same operands' shapes,
so the forward time stands for it in backward too. A collective beside no GEMM (an all-gather
into an elementwise op) gets none: nothing to decompose it with. No torch imports (solver layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from autopar.solver.costing import CommEvent

FUSABLE_GEMMS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.matmul.default")
"""The ops whose GEMM a tensor-parallel overlap decomposes with its collective (a linear layer's)."""

WINDOWED_OPS = ("all_gather", "reduce_scatter")
"""The collectives it decomposes (solver/tp_overlap.OVERLAPPED_OPS)."""

Window = tuple[tuple[str, float], ...]
"""(GEMM node, its forward seconds per microbatch on one rank) of the GEMMs beside a collective."""

Windowed = tuple[str, float, "Window | None"]
"""A collective's breakdown column, its seconds (its layout copy apart) and its window."""


def gemm_window(nodes: Iterable, forward_s: Callable[[object], float]) -> Window:
    """The GEMM ops among `nodes` with their own forward seconds (`forward_s(node)`)."""
    return tuple((node.name, forward_s(node)) for node in nodes if getattr(node, "target", "") in FUSABLE_GEMMS)


def with_windows(events: Sequence[CommEvent], *, producer: Window, consumers: Window,
                 sums: bool = True) -> tuple[CommEvent, ...]:
    """The edge's all-gathers and reduce-scatters with their GEMM window: the consumers' GEMMs for
    a forward all-gather and the reduce-scatter of its gradient, the producer's for a forward
    reduce-scatter and the all-gather of its gradient (see the module docstring). Under overlap
    (CommEvent.unfused_copy_s set), a fused one pays its kernel's pass (CommEvent.fused_pass_s), and
    one the runtime does not fuse (no GEMM beside it; a summed gradient's reduce-scatter where `sums`
    is False: PrecisionPolicy.tp_overlap_sums) keeps DTensor's path, its layout copy included, and no
    window. (The intra-op ILP prices the events before this: no copy under overlap.)"""
    return tuple(_windowed_event(event, consumers if (event.op == "all_gather") == (event.phase == "fwd")
                                 else producer, sums) if event.op in WINDOWED_OPS else event for event in events)


def _windowed_event(event: CommEvent, window: Window, sums: bool) -> CommEvent:
    if event.unfused_copy_s is None:
        return replace(event, window=window)
    fused = bool(window) and (sums or not event.summed)
    copy_s = event.fused_pass_s if fused else event.unfused_copy_s
    return replace(event, window=window if fused else (), copy_s=copy_s, time_s=event.time_s - event.copy_s + copy_s)


def windowed(event: CommEvent) -> Windowed:
    """The event as PreparedSegments keeps it for the caps (its column, collective seconds, window)."""
    return event.column, event.time_s - event.copy_s, event.window


def hideable_s(record: Windowed, speedups: Mapping[str, float] | None = None) -> float:
    """Of a collective's seconds, what its GEMM window can cover: all of them where no window was
    recorded (a collective priced without an edge); `speedups`: per GEMM node, how many times
    faster it runs than priced in the window (float8 linears: solver/fp8_segments.py)."""
    _, seconds, window = record
    if window is None:
        return seconds
    return min(seconds, sum(gemm_s / (speedups or {}).get(node, 1.0) for node, gemm_s in window))

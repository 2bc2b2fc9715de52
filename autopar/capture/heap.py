"""Python's cyclic garbage collector while planning: what is alive when a phase starts is frozen.

A full collection (CPython's generation 2) traverses every object the collector tracks. After
`import torch` and torch.export's first use (torch._dynamo, sympy) that is about 380,000
objects, 0.1-0.2 CPU s per full collection, and one cold `autopar plan gpt3-175b` ran seven
of them (0.5-0.9 CPU s of about 10) over objects that live until the process exits anyway:
modules, functions, classes. `gc.freeze()` moves the objects alive now to the permanent generation,
which collections skip; objects made afterwards are collected as before (`freeze_more`
adds those of an import made inside a phase). Frozen before the
search forks its workers, the parent's objects also stay out of the workers' collections,
which would otherwise write to (copy) every page of the inherited heap (the fork advice of
CPython's gc documentation).

Inside, the youngest generation is also collected every YOUNG_THRESHOLD allocations instead
of CPython's 700: tracing and searching make millions of short-lived objects, most freed by
reference counting before a larger threshold is reached, so fewer are traversed and promoted
(GPT-3 175B's cold plan: the collector's CPU time in the capture 0.25 -> 0.11 s, in the
search 0.10 -> 0.04 s; peak RSS unchanged, 364 MB).

Nothing frozen is lost: the outermost `frozen_heap` hands the objects back to the collector
when it ends (`gc.unfreeze`) and restores the thresholds, so a program calling the API keeps
its usual collector. A program that has frozen objects itself is left as it is (no freeze, no
unfreeze; the threshold is still raised inside).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000
"""Allocations between collections of the youngest generation inside frozen_heap."""

_depth = 0
_owned = False
"""Whether the outermost frozen_heap froze (and will unfreeze) the heap."""
_thresholds: tuple[int, ...] = ()
"""The thresholds the outermost frozen_heap found (restored when it ends)."""


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now (and, when nested, those made since the enclosing phase
    began) until the outermost phase ends."""
    global _depth, _owned, _thresholds
    if _depth == 0:
        _owned = gc.get_freeze_count() == 0
        _thresholds = gc.get_threshold()
        gc.set_threshold(max(_thresholds[0], YOUNG_THRESHOLD), *_thresholds[1:])
    if _owned:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.set_threshold(*_thresholds)
            if _owned:
                _owned = False
                gc.unfreeze()


def freeze_more() -> None:
    """Inside frozen_heap: freeze what was made since it began too (a phase's imports)."""
    if _depth and _owned:
        gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (imports: many long-lived objects, little garbage); the
    collector's previous state comes back after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_freeze_at_exit_registered = False


def freeze_at_exit() -> None:
    """When the interpreter exits, freeze the heap before it is torn down: its last full
    collection then skips the objects of torch and the planner, which the exit frees without
    collecting (0.35 of the 0.5 CPU s an `autopar plan` spent after printing its plan).
    Registered once per process; objects with finalizers in cycles are no more promised a
    finalizer at exit than they were (Python does not guarantee __del__ at exit)."""
    global _freeze_at_exit_registered
    if not _freeze_at_exit_registered:
        _freeze_at_exit_registered = True
        atexit.register(gc.freeze)

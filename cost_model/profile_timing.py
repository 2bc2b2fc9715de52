"""Timing helpers shared by the profiler's compute and collective sweeps."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

ProgressFn = Callable[[str, float], None]


# --- progress ------------------------------------------------------------------------------


class Progress:
    """Maps a phase's own 0..1 progress into its span of the whole run."""

    def __init__(self, callback: ProgressFn | None, start: float = 0.0, end: float = 1.0) -> None:
        self.callback, self.start, self.end = callback, start, end

    def __call__(self, message: str, fraction: float) -> None:
        if self.callback is not None:
            self.callback(message, self.start + (self.end - self.start) * min(max(fraction, 0.0), 1.0))

    def span(self, start: float, end: float) -> "Progress":
        width = self.end - self.start
        return Progress(self.callback, self.start + width * start, self.start + width * end)


# --- timing --------------------------------------------------------------------------------


class Timer:
    """Per-call time of `count` back-to-back calls; on CUDA, synchronized before and after.

    clock "wall" is time.perf_counter. clock "cpu" is the calling thread's CPU time
    (time.thread_time, user + system): on a machine shared with other jobs it leaves out the time
    they held the core, so it estimates what a dedicated core would take. It sees only the
    calling thread, so it is right only for single-threaded CPU work.
    """

    def __init__(self, device: str, clock: str = "wall") -> None:
        self.synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.now = time.thread_time if clock == "cpu" else time.perf_counter

    def per_call_s(self, function: Callable[[], object], count: int = 1) -> float:
        self.synchronize()
        start = self.now()
        for _ in range(count):
            function()
        self.synchronize()
        return (self.now() - start) / count

    def warm_per_call_s(self, function: Callable[[], object], warmup: int) -> float:
        """Warm up, then a first estimate of one call's time."""
        for _ in range(warmup):
            function()
        once_s = self.per_call_s(function)
        return self.per_call_s(function, 10) if once_s < 1e-3 else once_s

    def calls_per_sample(self, function: Callable[[], object], warmup: int, min_sample_s: float) -> int:
        """Warm up, then how many calls make one sample last `min_sample_s`."""
        return calls_for(self.warm_per_call_s(function, warmup), min_sample_s)


def calls_for(per_call_s: float, min_sample_s: float, limit: int = 100_000) -> int:
    """Back-to-back calls that one sample needs to last `min_sample_s`."""
    return max(1, min(limit, math.ceil(min_sample_s / max(per_call_s, 1e-9))))


def interleaved_medians(timer: Timer, cases: Sequence[Callable[[], object]], *, warmup: int, repeats: int,
                        min_sample_s: float, deadline_s: float, min_rounds: int = 3,
                        on_round: Callable[[int], None] | None = None) -> list[float]:
    """Median per-call time of each case over rounds that each time every case once."""
    counts = [timer.calls_per_sample(case, warmup, min_sample_s) for case in cases]
    samples: list[list[float]] = [[] for _ in cases]
    for round_index in range(repeats):
        for case, count, times in zip(cases, counts, samples):
            times.append(timer.per_call_s(case, count))
        if on_round is not None:
            on_round(round_index + 1)
        if round_index + 1 >= min_rounds and time.time() > deadline_s:
            break
    return [statistics.median(times) for times in samples]


def threads_per_process(device: str, num_processes: int) -> int:
    """Torch threads each process gets: its share of the cores (GPU processes keep the default)."""
    if device == "cuda":
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // max(num_processes, 1))


def compute_device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

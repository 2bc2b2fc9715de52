"""`pm.timing_report()`: the step time a ParallelModule really takes, against the plan's.

ParallelModule records when each `train_step` starts and how long it runs. A loop's step is the
interval between two starts (train_step, the optimizer step and whatever else the loop does,
data loading included), which is what the plan predicts; the first `skip` steps (warm-up) are
left out. Every rank must call it: the slowest rank's medians are taken.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class TimingReport:
    """Measured against predicted step time of a plan."""

    num_steps: int
    """Loop steps measured (intervals between train_step starts after warm-up)."""
    measured_step_s: float | None
    """Median interval between train_step starts (slowest rank); None before two steps."""
    measured_train_step_s: float | None
    """Median time inside train_step (forward, backward, gradient sync; no optimizer)."""
    predicted_step_s: float
    expected_error: float
    """The plan's expected relative error (0: uncalibrated, unknown)."""

    @property
    def error(self) -> float | None:
        """predicted / measured - 1."""
        return self.predicted_step_s / self.measured_step_s - 1.0 if self.measured_step_s else None

    def __str__(self) -> str:
        if self.measured_step_s is None:
            return "timing: fewer than two steps after warm-up were run; nothing to compare yet"
        bar = (f"; the plan expected +-{100 * self.expected_error:.0f}%" if self.expected_error
               else "; the profile has no calibration (`autopar profile --calibrate MODEL` gives an error bar)")
        return (f"timing over {self.num_steps} steps (slowest rank, median): step {self.measured_step_s * 1e3:.1f} ms "
                f"(train_step {self.measured_train_step_s * 1e3:.1f} ms), predicted {self.predicted_step_s * 1e3:.1f} "
                f"ms: {100 * self.error:+.0f}%{bar}")


def timing_report(starts_s: list[float], durations_s: list[float], plan, *, skip: int = 2) -> TimingReport:
    intervals = [later - earlier for earlier, later in zip(starts_s[skip:], starts_s[skip + 1:])]
    inside = durations_s[skip:]
    values = torch.tensor([statistics.median(intervals) if intervals else -1.0,
                           statistics.median(inside) if inside else -1.0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    step_s, inside_s = (float(v) if v >= 0 else None for v in values.tolist())
    return TimingReport(num_steps=len(intervals), measured_step_s=step_s, measured_train_step_s=inside_s,
                        predicted_step_s=plan.predicted.step_time_s, expected_error=plan.predicted.expected_error)

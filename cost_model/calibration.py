"""Whole-step calibration: the figures a kernel-by-kernel cost model lacks, fitted to real steps.

The profile measures kernels and collectives one at a time. A training step adds costs that no
isolated measurement sees: the framework's per-op dispatch (eager autograd, more under DTensor),
several processes sharing few CPU cores, collectives issued as many small calls, pipeline
schedule actions, FSDP hooks, overlap that is less than perfect, the optimizer's per-tensor
work. `autopar profile --calibrate MODEL` runs a small fixed set of configurations for a few
steps, and a non-negative least-squares fit over their measured step times gives one
coefficient per term (TERMS below). The step model then adds

    term_seconds = coefficient x feature(configuration)

for each term, where the features are counts and times the step model already knows (ops on
the critical path, collective calls, pipeline actions, FSDP units, the optimizer's tensors).
The fit's leave-one-out residuals give the plan's expected error.

This module holds the data (typed, versioned, stored inside the profile JSON) and the rule for
which calibration applies to a cluster; the features and the fit live in autopar (solver and
tune); nothing here imports autopar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cost_model.errors import CostModelInputError

CALIBRATION_VERSION = 2
"""2 (2026-12-06): framework.dtensor_dispatch per aten op dispatched through DTensor (was per
captured op)."""

TERMS: dict[str, str] = {
    "compute.in_step": "multiplier on the predicted compute, bubble and optimizer time as they run inside a "
                       "step (caches, allocator, the other processes' memory traffic)",
    "framework.eager_ops": "seconds per op executed (eager dispatch and autograd, forward + backward)",
    "framework.dtensor_dispatch": "extra seconds per aten op dispatched on DTensors (tensor parallelism; a "
                                  "linear dispatches about 9 forward and backward, a pointwise op 2)",
    "comm.pattern": "multiplier on the predicted collective time in the pattern a step issues",
    "comm.calls": "seconds per collective call issued (gloo/NCCL call and synchronisation overhead)",
    "pp.schedule": "seconds per pipeline schedule action (one microbatch forward or backward on a stage, "
                   "with its send/recv)",
    "dp.hooks": "seconds per FSDP unit and microbatch (pre/post forward and backward hooks)",
    "dp.overlap": "seconds in the step per second of gradient synchronisation the model assumes hidden: the "
                  "share not hidden, times how much slower the synchronisation runs beside compute than alone "
                  "(so it can exceed 1)",
    "optimizer.per_tensor": "seconds per parameter tensor of the optimizer step",
}
"""Calibrated terms by name (the step-time breakdown uses these names)."""

CPU_WORK_TERMS = ("compute.in_step", "framework.eager_ops", "framework.dtensor_dispatch", "pp.schedule",
                  "dp.hooks", "optimizer.per_tensor")
"""Terms that are CPU work on the host: slowed down when processes outnumber cores."""


@dataclass(frozen=True, kw_only=True)
class CalibrationPoint:
    """One configuration the calibration ran."""

    config: str
    """The configuration, as ParallelConfig.describe() writes it."""
    model: str = ""
    """The model spec it ran (a calibration may pool several models: Calibration.model names all)."""
    predicted_s: float
    """Step time the uncalibrated model predicted."""
    measured_s: float
    """Median measured step time (slowest rank)."""
    features: dict[str, float]
    """Feature of each term for this configuration."""
    fitted_s: float = 0.0
    """Step time of the fitted model (all points in the fit)."""
    held_out_s: float = 0.0
    """Step time of the model fitted without this point (leave-one-out)."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Fitted whole-step terms for one machine, one process count and one torch version."""

    version: int
    """Format version of this section (CALIBRATION_VERSION)."""
    model: str
    """Model(s) the configurations ran (a spec or class name; several joined by " ; ")."""
    num_processes: int
    """Processes per node during the calibration."""
    num_cores: int
    """CPU cores of the machine (processes beyond them share cores)."""
    host: str
    """Host it was measured on."""
    device_name: str
    """Device of the profile it belongs to."""
    torch_version: str
    """torch version (framework overheads change with it)."""
    coefficients: dict[str, float]
    """Coefficient per term of TERMS (see there for units)."""
    expected_error: float
    """Median |held-out prediction / measured - 1| over the points: the plan's typical error."""
    worst_error: float
    """Largest such error over the points."""
    points: tuple[CalibrationPoint, ...] = ()
    """The configurations measured, with what the fit made of them."""
    load_average: float = 0.0
    """1-minute load average when the calibration started (other jobs slow every figure)."""
    created: str = ""
    """ISO timestamp."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def coefficient(self, term: str) -> float:
        return self.coefficients.get(term, 1.0 if _is_multiplier(term) else 0.0)


def _is_multiplier(term: str) -> bool:
    return term in ("compute.in_step", "comm.pattern")


def is_multiplier(term: str) -> bool:
    """Multipliers scale a predicted time (1 = as predicted); the other terms add seconds per count."""
    return _is_multiplier(term)


def core_sharing_factor(processes_per_node: int, num_cores: int) -> float:
    """How much longer CPU work takes when processes outnumber cores (each gets cores/procs)."""
    if num_cores < 1:
        return 1.0
    return max(1.0, processes_per_node / num_cores)


def select_calibration(calibrations: tuple[Calibration, ...], *, processes_per_node: int, device_name: str,
                       host: str, torch_version: str, source: str = "<profile>") -> Calibration | None:
    """The calibration made with this many processes per node (else the nearest count), or
    None without any; raises CostModelInputError when they were made for another machine or
    torch version (their overheads would not apply)."""
    if not calibrations:
        return None
    for calibration in calibrations:
        if calibration.device_name != device_name or calibration.host != host:
            raise CostModelInputError(
                f"profile '{source}': its calibration was measured on {calibration.host} ({calibration.device_name}), "
                f"but the profile is of {host or 'another host'} ({device_name}); calibrate this machine with "
                "`autopar profile --calibrate MODEL`")
        if calibration.torch_version.split("+")[0] != torch_version.split("+")[0]:
            raise CostModelInputError(
                f"profile '{source}': its calibration was made with torch {calibration.torch_version}, this is torch "
                f"{torch_version}; framework overheads change between versions: re-run `autopar profile --calibrate`")
    return min(calibrations, key=lambda c: (abs(c.num_processes - processes_per_node), -c.num_processes))


# --- JSON ---------------------------------------------------------------------------------------


def is_stale(data: Any) -> bool:
    """A stored calibration made by an earlier autopar (an older CALIBRATION_VERSION): its terms
    had other units, so it cannot price, and re-calibrating replaces it."""
    version = data.get("version") if isinstance(data, dict) else None
    return isinstance(version, int) and not isinstance(version, bool) and 0 < version < CALIBRATION_VERSION


def calibration_from_dict(data: Any, *, source: str) -> Calibration:
    where = f"profile '{source}': calibration"
    if not isinstance(data, dict):
        raise CostModelInputError(f"{where} must be an object")
    if data.get("version") != CALIBRATION_VERSION:
        raise CostModelInputError(f"{where} has version {data.get('version')!r}, this autopar reads "
                                  f"{CALIBRATION_VERSION}: re-run `autopar profile --calibrate MODEL`")
    coefficients = data.get("coefficients")
    if not isinstance(coefficients, dict):
        raise CostModelInputError(f"{where}: 'coefficients' must be an object of term -> number")
    unknown = sorted(set(coefficients) - set(TERMS))
    if unknown:
        raise CostModelInputError(f"{where}: unknown term(s) {unknown}; known: {sorted(TERMS)}")
    for name, value in coefficients.items():
        _check_number(f"{where}.coefficients.{name}", value, minimum=0.0)
    try:
        points = tuple(CalibrationPoint(**{**point, "features": dict(point["features"])})
                       for point in data.get("points", ()))
        values = {key: data[key] for key in ("model", "num_processes", "num_cores", "host", "device_name",
                                             "torch_version", "expected_error", "worst_error")}
    except (KeyError, TypeError) as error:
        raise CostModelInputError(f"{where} is missing or has a malformed field ({error}); "
                                  "re-run `autopar profile --calibrate MODEL`") from None
    for name in ("num_processes", "num_cores"):
        if not isinstance(values[name], int) or values[name] < 1:
            raise CostModelInputError(f"{where}.{name} must be a positive integer, got {values[name]!r}")
    for name in ("expected_error", "worst_error"):
        _check_number(f"{where}.{name}", values[name], minimum=0.0)
    return Calibration(version=CALIBRATION_VERSION, coefficients={k: float(v) for k, v in coefficients.items()},
                       points=points, load_average=float(data.get("load_average", 0.0)),
                       created=str(data.get("created", "")), notes=tuple(data.get("notes", ())), **values)


def _check_number(name: str, value: Any, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise CostModelInputError(f"profile: {name} must be a finite number >= {minimum}, got {value!r}")

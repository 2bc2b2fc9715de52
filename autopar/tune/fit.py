"""Fit the calibrated terms to measured steps: non-negative least squares in relative error.

For configuration i with uncalibrated prediction P_i, measured time M_i and term features
f_ij (autopar/solver/overheads.py), the calibrated prediction is linear in the coefficients:

    T_i(c) = R_i + sum_j c_j x s_ij x f_ij

where s_ij is the configuration's core-sharing factor (feature "cpu.sharing") for CPU work
terms (1 otherwise) and R_i is what the
multiplier terms do not cover (P_i minus their features). The fit minimises
sum_i ((T_i - M_i) / M_i)^2 over c >= floor (Lawson-Hanson active set on c - floor): relative,
because the plan's error is judged relative; bounded, because every term costs time and a
multiplier of what the profile measured alone is at least 1 (else the fit trades the measured
compute or collective time against a collinear count term, as noisy points invite). The expected error is the median leave-one-out |T_i / M_i - 1|: each point
predicted by the fit of the others, so the error bar is not the fit's own residual.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from autopar.errors import ConfigError
from cost_model.calibration import CPU_WORK_TERMS, TERMS, CalibrationPoint, is_multiplier


Observation = CalibrationPoint
"""One measured configuration: the point the calibration stores (its fitted times unset)."""


@dataclass(frozen=True, kw_only=True)
class FitResult:
    coefficients: dict[str, float]
    fitted_s: tuple[float, ...]
    held_out_s: tuple[float, ...]
    expected_error: float
    """Median leave-one-out |prediction / measured - 1|."""
    worst_error: float


def design(observations: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
    """Columns per term (TERMS order) and the part of each prediction no term covers."""
    columns = np.zeros((len(observations), len(TERMS)))
    rest = np.zeros(len(observations))
    for row, observation in enumerate(observations):
        rest[row] = observation.predicted_s
        sharing = observation.features.get("cpu.sharing", 1.0)
        for column, term in enumerate(TERMS):
            feature = observation.features.get(term, 0.0)
            columns[row, column] = feature * (sharing if term in CPU_WORK_TERMS else 1.0)
            if is_multiplier(term):
                rest[row] -= feature
    return columns, rest


def fit(observations: list[Observation]) -> FitResult:
    if len(observations) < 3:
        raise ConfigError(f"calibration needs at least 3 measured configurations, got {len(observations)}")
    columns, rest = design(observations)
    measured = np.array([o.measured_s for o in observations])
    coefficients = _solve(columns, rest, measured)
    fitted = rest + columns @ coefficients
    held_out = np.zeros(len(observations))
    for row in range(len(observations)):
        keep = np.arange(len(observations)) != row
        held_out[row] = rest[row] + columns[row] @ _solve(columns[keep], rest[keep], measured[keep])
    errors = np.abs(held_out / measured - 1.0)
    return FitResult(coefficients={term: float(c) for term, c in zip(TERMS, coefficients)},
                     fitted_s=tuple(float(x) for x in fitted), held_out_s=tuple(float(x) for x in held_out),
                     expected_error=float(statistics.median(errors)), worst_error=float(errors.max()))


def unexercised_terms(observations: list[Observation]) -> list[str]:
    """Terms whose feature is 0 on every observation: the fit cannot see them, so they keep their
    floor (a multiplier 1, a count term 0) whatever they cost on other models (`_solve`'s unused
    columns)."""
    used = _used(design(observations)[0])
    return [term for term, seen in zip(TERMS, used) if not seen]


def _used(columns: np.ndarray) -> np.ndarray:
    """Per term, whether any observation's column is non-zero (else the fit leaves its floor)."""
    return np.abs(columns).sum(axis=0) > 0


def _solve(columns: np.ndarray, rest: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """min_c ||(rest + columns c - measured) / measured|| subject to c >= floor, where the floor
    is 1 for multipliers (a kernel or collective inside a step is not faster than the profile
    measured it alone) and 0 for the other terms; unused columns (all zero) keep the floor."""
    floor = np.array([1.0 if is_multiplier(term) else 0.0 for term in TERMS])
    weights = 1.0 / measured
    matrix = columns * weights[:, None]
    target = (measured - rest - columns @ floor) * weights
    used = _used(columns)
    solution = floor.copy()
    if used.any():
        scale = np.linalg.norm(matrix[:, used], axis=0)
        solution[used] += nnls(matrix[:, used] / scale, target) / scale
    return solution


def nnls(matrix: np.ndarray, target: np.ndarray, *, max_iterations: int = 200) -> np.ndarray:
    """Lawson and Hanson's active-set algorithm for min ||A x - b||, x >= 0."""
    num_columns = matrix.shape[1]
    x = np.zeros(num_columns)
    passive = np.zeros(num_columns, dtype=bool)
    tolerance = 1e-10 * max(1.0, float(np.abs(matrix).max(initial=0.0)))
    for _ in range(max_iterations):
        gradient = matrix.T @ (target - matrix @ x)
        candidates = ~passive & (gradient > tolerance)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(num_columns)
            z[passive] = np.linalg.lstsq(matrix[:, passive], target, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            gap = x[blocking] - z[blocking]
            step = float(np.min(np.where(gap > 0, x[blocking] / np.where(gap > 0, gap, 1.0), 0.0)))
            x = x + step * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x

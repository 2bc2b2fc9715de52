"""The calibration fit: non-negative least squares in relative error, leave-one-out errors."""

import numpy as np
import pytest

from autopar.errors import ConfigError
from autopar.tune.fit import Observation, fit, nnls
from cost_model.calibration import TERMS


def test_nnls_matches_least_squares_when_the_optimum_is_positive():
    rng = np.random.default_rng(0)
    matrix = rng.uniform(0.1, 1.0, size=(12, 4))
    truth = np.array([0.5, 2.0, 0.1, 1.0])
    assert np.allclose(nnls(matrix, matrix @ truth), truth, atol=1e-8)


def test_nnls_keeps_coefficients_non_negative():
    matrix = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    target = np.array([1.0, -2.0, -1.0])
    solution = nnls(matrix, target)
    assert (solution >= 0).all() and solution[1] == 0.0


def _observations(coefficients: dict, sharing: float, count: int = 10) -> list[Observation]:
    """Synthetic steps made by the calibrated model itself with known coefficients."""
    rng = np.random.default_rng(1)
    found = []
    for index in range(count):
        features = {"compute.in_step": rng.uniform(0.05, 0.2), "comm.pattern": rng.uniform(0.0, 0.05),
                    "framework.eager_ops": rng.uniform(200, 2000), "comm.calls": rng.uniform(5, 200),
                    "pp.schedule": float(rng.integers(0, 3)) * 8, "cpu.sharing": sharing}
        predicted = features["compute.in_step"] + features["comm.pattern"] + 0.01
        measured = 0.01 + sum(coefficients.get(term, 0.0) * value * (sharing if term in ("compute.in_step",
                              "framework.eager_ops", "pp.schedule") else 1.0) for term, value in features.items()
                              if term in TERMS)
        found.append(Observation(config=f"c{index}", predicted_s=predicted, measured_s=measured, features=features))
    return found


def test_fit_recovers_the_coefficients_that_made_the_steps():
    truth = {"compute.in_step": 1.3, "comm.pattern": 2.0, "framework.eager_ops": 4e-5, "comm.calls": 1e-4,
             "pp.schedule": 2e-3}
    result = fit(_observations(truth, sharing=2.0))
    for term, value in truth.items():
        assert result.coefficients[term] == pytest.approx(value, rel=1e-6), term
    assert result.expected_error < 1e-6 and set(result.coefficients) == set(TERMS)
    unused = set(TERMS) - set(truth)
    assert all(result.coefficients[term] == 0.0 for term in unused if term not in ("compute.in_step", "comm.pattern"))


def test_the_error_bar_is_held_out():
    observations = _observations({"compute.in_step": 1.0, "framework.eager_ops": 1e-4}, sharing=1.0)
    noisy = [Observation(config=o.config, predicted_s=o.predicted_s, measured_s=o.measured_s * (1.3 if i == 3 else 1.0),
                         features=o.features) for i, o in enumerate(observations)]
    result = fit(noisy)
    held_out_error = abs(result.held_out_s[3] / noisy[3].measured_s - 1)
    fitted_error = abs(result.fitted_s[3] / noisy[3].measured_s - 1)
    assert held_out_error > fitted_error > 0
    assert result.worst_error == pytest.approx(max(abs(h / o.measured_s - 1) for h, o in zip(result.held_out_s, noisy)))


def test_fit_needs_a_few_points():
    with pytest.raises(ConfigError, match="at least 3"):
        fit(_observations({"compute.in_step": 1.0}, sharing=1.0, count=2))


def _steps_of_one_model(scale: float) -> list[Observation]:
    """Steps whose collectives cost 1.6 x their predicted time plus 2e-3 s a call, from a model
    whose messages are `scale` times the base size: the same calls, `scale` times the bytes."""
    found = []
    for index, calls in enumerate((10, 20, 40, 60, 80, 120)):
        comm_s = scale * calls * 1e-4  # one message size per call: time proportional to calls
        features = {"compute.in_step": 0.1 * scale, "comm.pattern": comm_s, "comm.calls": float(calls)}
        measured = 0.1 * scale + 1.6 * comm_s + 2e-3 * calls
        found.append(Observation(config=f"c{index}", model=f"x{scale}", predicted_s=0.1 * scale + comm_s,
                                 measured_s=measured, features=features))
    return found


def test_two_message_sizes_separate_the_per_byte_and_the_per_call_collective_terms():
    """With one model every call moves messages of one size, so 'per byte' and 'per call' are the
    same column up to a factor and the fit may pick either; a second model with twice the
    messages at the same calls tells them apart (why `--calibrate` takes several models)."""
    one = fit(_steps_of_one_model(1.0))
    assert one.expected_error < 1e-6  # it fits its own points perfectly ...
    assert not (one.coefficients["comm.pattern"] == pytest.approx(1.6, rel=1e-3)
                and one.coefficients["comm.calls"] == pytest.approx(2e-3, rel=1e-3))  # ... with the wrong split
    both = fit(_steps_of_one_model(1.0) + _steps_of_one_model(2.0))
    assert both.coefficients["comm.pattern"] == pytest.approx(1.6, rel=1e-6)
    assert both.coefficients["comm.calls"] == pytest.approx(2e-3, rel=1e-6)


def test_unexercised_terms_are_those_zero_in_every_configuration():
    from autopar.tune.fit import unexercised_terms

    observations = _observations({"compute.in_step": 1.2}, sharing=1.0, count=4)
    unseen = unexercised_terms(observations)
    assert "framework.dtensor_dispatch" in unseen and "dp.hooks" in unseen
    assert "compute.in_step" not in unseen and "framework.eager_ops" not in unseen
    one = [Observation(config="tp", predicted_s=0.1, measured_s=0.2, features={"framework.dtensor_dispatch": 40.0})]
    assert "framework.dtensor_dispatch" not in unexercised_terms(observations + one)

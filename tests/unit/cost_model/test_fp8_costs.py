"""Float8 training's casts and bytes, from torchao's eager sequence (cost_model/fp8.py)."""

import pytest

from cost_model import fp8
from cost_model.hardware import A100_80G, H100_SXM, H200_SXM


def test_an_eager_cast_moves_33_bytes_per_element():
    # bf16: abs (2+2), max (2), to fp32 (2+4), mul (4+4), clamp (4+4), to fp8 (4+1).
    assert fp8.cast_bytes_per_element(2) == 33
    # fp32 (FSDP2's float8 gather casts the master shard): no widening copy.
    assert fp8.cast_bytes_per_element(4) == 33
    assert fp8.cast_kernels(2) == fp8.cast_kernels(4) + 1


def test_a_linear_casts_six_operands_four_when_the_weight_arrives_in_float8():
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    assert fp8.num_casts(weight_precast=False) == 6 and fp8.num_casts(weight_precast=True) == 4
    assert fp8.cast_elements(linear, weight_precast=False) == 2 * 10 + 2 * 100 + 2 * 20
    assert fp8.cast_elements(linear, weight_precast=True) == 2 * 10 + 2 * 20
    assert fp8.transient_bytes(linear) == max(10 + 100, 2 * 20 + 100 + 10)
    assert fp8.all_gather_bytes_saved(100.0, 2) == 100.0


def test_hopper_has_twice_the_bf16_peak_in_fp8_and_ampere_none():
    for device in (H100_SXM, H200_SXM):
        assert device.has_fp8 and device.peak_flops("fp8") == pytest.approx(2 * device.peak_flops("bf16"), rel=1e-3)
    assert not A100_80G.has_fp8
    assert A100_80G.peak_flops("fp8") == A100_80G.peak_flops("bf16")  # emulated at the bf16 rate

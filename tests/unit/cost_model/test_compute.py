from dataclasses import replace

import pytest

from autopar.cluster import Cluster
from cost_model.compute import ComputeModel
from autopar.graph import Kernel
from cost_model.profile import AttentionPoint, ElementwisePoint, HardwareProfile, MatmulPoint


def test_large_matmuls_run_near_but_not_at_peak():
    device = Cluster.from_spec("dgx-a100-80g").device
    model = ComputeModel(device)
    rate = model.matmul_rate(2 * 8192**3, "bfloat16")
    assert 0.6 * device.peak_flops("bf16") < rate < device.peak_flops("bf16")
    small = model.matmul_rate(2 * 64**3, "bfloat16")
    assert small < 0.1 * rate


def test_memory_bound_kernels_priced_by_bytes():
    device = Cluster.from_spec("dgx-h100").device
    model = ComputeModel(device)
    time = model.kernel(flops=1e6, io_bytes=1e9, is_matmul=False, dtype="bfloat16")
    expected = 1e9 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    assert time.memory_s == pytest.approx(expected)
    assert time.matmul_s == 0
    assert time.total_s == pytest.approx(expected + device.kernel_overhead_s)


def test_roofline_picks_the_bound():
    model = ComputeModel(Cluster.from_spec("dgx-a100-80g").device)
    skinny = model.kernel(flops=2 * 8192 * 8192 * 1, io_bytes=2 * 8192 * 8192 * 2, is_matmul=True, dtype="bfloat16")
    assert skinny.memory_s > 0 and skinny.matmul_s == 0
    fat = model.kernel(flops=2 * 4096**3, io_bytes=3 * 4096**2 * 2, is_matmul=True, dtype="bfloat16")
    assert fat.matmul_s > 0 and fat.memory_s == 0


def test_fp32_matmuls_are_slower_than_bf16():
    model = ComputeModel(Cluster.from_spec("dgx-a100-80g").device)
    assert model.matmul_rate(1e12, "float32") < model.matmul_rate(1e12, "bfloat16") / 4


def test_profile_table_is_interpolated():
    profile = HardwareProfile(
        schema_version=1, device_kind="cpu", device_name="CPU", num_processes=1, memory_bytes=1e9,
        memory_bandwidth_bytes_per_s=1e10, kernel_overhead_s=1e-5,
        matmul=(MatmulPoint(dtype="fp32", flops=1e6, achieved_flops_per_s=1e9),
                MatmulPoint(dtype="fp32", flops=1e8, achieved_flops_per_s=5e10)))
    model = ComputeModel(Cluster.from_spec("cpu").device, profile)
    assert model.matmul_rate(1e8, "float32") == pytest.approx(5e10)
    assert model.matmul_rate(1e10, "float32") == pytest.approx(5e10)
    assert 1e9 < model.matmul_rate(1e7, "float32") < 5e10
    assert model.matmul_rate(1e5, "float32") < 1e9
    assert model.bandwidth_bytes_per_s == 1e10


def _gpu_model(*, bandwidth_bytes_per_s: float = 4e12, **measured) -> ComputeModel:
    """A GPU profile with one bf16 matmul point (1 TFLOP/s) and `measured` (attention=...,
    elementwise=...)."""
    profile = HardwareProfile(
        schema_version=2, device_kind="cuda", device_name="GPU", num_processes=1, memory_bytes=1e9,
        memory_bandwidth_bytes_per_s=bandwidth_bytes_per_s, kernel_overhead_s=0.0,
        matmul=(MatmulPoint(dtype="bf16", flops=1e9, achieved_flops_per_s=1e12),), **measured)
    return ComputeModel(Cluster.from_spec("cpu").device, profile)


def test_fused_attention_meets_the_measured_rate_of_its_phase_and_mask():
    rates = {("forward", True): 4e12, ("forward", False): 2e12, ("backward", True): 3e12, ("backward", False): 1e12}
    attention = tuple(AttentionPoint(phase=phase, causal=causal, flops=flops, achieved_flops_per_s=rate)
                      for (phase, causal), rate in rates.items() for flops in (1e9, 1e12))
    measured, plain = _gpu_model(attention=attention), _gpu_model()
    for (phase, causal), rate in rates.items():
        name = f"aten._scaled_dot_product_flash_attention{'_backward' if phase == 'backward' else ''}.default"
        kernel = Kernel(name=name, flops=1e11, io_bytes=1e6, is_matmul=True, dtype="bfloat16", causal=causal)
        assert measured.kernels([kernel]).total_s == pytest.approx(1e11 / rate)
        assert plain.kernels([kernel]).total_s == pytest.approx(1e11 / 1e12)  # no sweep: a matmul of its count
    mm = Kernel(name="aten.mm.default", flops=1e11, io_bytes=1e6, is_matmul=True, dtype="bfloat16")
    assert measured.kernels([mm]).total_s == pytest.approx(1e11 / 1e12)


def test_widening_casts_meet_the_measured_upcast_rate():
    model = _gpu_model(elementwise=(ElementwisePoint(kind="upcast", elements_per_s=3.5e11),))
    elements = 1e9
    cast = lambda dtype, bytes_per_element: Kernel(  # noqa: E731
        name="aten._to_copy.default", flops=elements, io_bytes=bytes_per_element * elements, is_matmul=False,
        dtype=dtype)
    assert model.kernels([cast("bfloat16", 6)]).total_s == pytest.approx(elements / 3.5e11)  # bf16 -> fp32
    assert model.kernels([cast("float32", 6)]).total_s == pytest.approx(6 * elements / 4e12)  # fp32 -> bf16
    assert model.kernels([cast("bfloat16", 4)]).total_s == pytest.approx(4 * elements / 4e12)  # a bf16 copy


def test_pointwise_kernels_with_a_broadcast_operand_meet_the_measured_broadcast_rate():
    model = _gpu_model(elementwise=(ElementwisePoint(kind="broadcast", elements_per_s=3e11),))
    fill = lambda broadcast: Kernel(name="aten.masked_fill.Scalar", flops=1e9, io_bytes=4e9,  # noqa: E731
                                    is_matmul=False, dtype="bfloat16", broadcast=broadcast)
    assert model.kernels([fill(True)]).total_s == pytest.approx(1e9 / 3e11)
    assert model.kernels([fill(False)]).total_s == pytest.approx(4e9 / 4e12)


def test_a_grouped_matmul_runs_each_experts_matmul_at_the_rate_of_its_own_size():
    """128 experts of 32 rows each are far slower than one [4096, K] x [K, N] matmul of the same
    FLOPs; as experts get more rows (fewer per device under expert parallelism) they speed up."""
    model = ComputeModel(Cluster.from_spec("dgx-h100").device)
    flops, size = 2.0 * 4096 * 2048 * 768, 3 * 4096 * 2048 * 2.0
    one = model.kernel(flops, size, True, "bfloat16", "aten._grouped_mm.default")
    grouped = model.kernel(flops, size, True, "bfloat16", "aten._grouped_mm.default", groups=128)
    fewer = model.kernel(flops, size, True, "bfloat16", "aten._grouped_mm.default", groups=16)
    assert grouped.total_s > 2 * one.total_s
    assert one.total_s < fewer.total_s < grouped.total_s
    assert grouped.matmul_s == pytest.approx(flops / model.matmul_rate(flops / 128, "bfloat16"))
    kernel = Kernel(name="aten._grouped_mm.default", flops=flops, io_bytes=size, is_matmul=True, dtype="bfloat16")
    dense = Kernel(name="aten.mm.default", flops=flops, io_bytes=size, is_matmul=True, dtype="bfloat16")
    assert model.kernels([kernel], groups=128).total_s == pytest.approx(grouped.total_s)
    assert model.kernels([dense], groups=128).total_s == pytest.approx(one.total_s)  # groups: grouped kernels only


def test_without_a_profile_a_named_attention_kernel_prices_attention_at_its_documented_rate():
    """torch counts the whole square; a causal kernel does half of it, at its causal rate."""
    h100 = Cluster.from_spec("dgx-h100").device
    named = ComputeModel(replace(h100, attention_kernel="flash2"))
    plain = ComputeModel(h100)
    flops = 4.0 * 32 * 16384**2 * 128  # one forward, b 1, 32 heads, seq 16k, head dim 128
    for phase, suffix in (("forward", ""), ("backward", "_backward")):
        name = f"aten._scaled_dot_product_flash_attention{suffix}.default"
        for causal in (True, False):
            kernel = Kernel(name=name, flops=flops, io_bytes=1e6, is_matmul=True, dtype="bfloat16", causal=causal)
            work = flops / 2 if causal else flops
            rate = h100.peak_flops("bf16") * h100.attention_kernels[0].efficiency(phase, causal)
            size = work / (work + h100.matmul_half_efficiency_flops)
            assert named.kernels([kernel]).matmul_s == pytest.approx(work / (rate * size))
            assert plain.kernels([kernel]).matmul_s == pytest.approx(flops / plain.matmul_rate(flops, "bfloat16"))
    mm = Kernel(name="aten.mm.default", flops=flops, io_bytes=1e6, is_matmul=True, dtype="bfloat16")
    assert named.kernels([mm]).total_s == pytest.approx(plain.kernels([mm]).total_s)
    narrow = Kernel(name="aten._scaled_dot_product_flash_attention.default", flops=flops, io_bytes=1e6,
                    is_matmul=True, dtype="bfloat16", head_dim=64)
    wide = replace(narrow, head_dim=128)
    assert named.kernels([narrow]).matmul_s == pytest.approx(named.kernels([wide]).matmul_s * 370 / 324, rel=1e-3)


def test_a_measured_attention_sweep_overrules_the_named_kernel():
    rates = {("forward", True): 4e12, ("forward", False): 2e12, ("backward", True): 3e12, ("backward", False): 1e12}
    attention = tuple(AttentionPoint(phase=phase, causal=causal, flops=flops, achieved_flops_per_s=rate)
                      for (phase, causal), rate in rates.items() for flops in (1e9, 1e12))
    device = replace(Cluster.from_spec("dgx-h100").device, attention_kernel="cudnn")
    profile = _gpu_model(attention=attention).profile
    model = ComputeModel(device, profile)
    kernel = Kernel(name="aten._scaled_dot_product_flash_attention.default", flops=1e11, io_bytes=1e6,
                    is_matmul=True, dtype="bfloat16", causal=True)
    assert model.kernels([kernel]).total_s == pytest.approx(1e11 / 4e12)

"""Float8 training's casts and bytes, from torchao's eager sequence (cost_model/fp8.py)."""

from dataclasses import replace

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


def test_the_profile_measures_fp8_with_scaled_mm_on_gpus_only():
    import torch

    from cost_model.errors import CostModelInputError
    from cost_model.profile_options import ProfileOptions
    from cost_model.profiler import _scaled_mm_case, _with_fp8_where_supported

    with pytest.raises(CostModelInputError, match="torch._scaled_mm on GPUs"):
        ProfileOptions(device="cpu", matmul_dtypes=("fp8",))
    assert "fp8" not in ProfileOptions(device="cpu").resolved().matmul_dtypes
    cpu = torch.device("cpu")
    assert _with_fp8_where_supported(cpu, ("bf16", "fp8")) == ("bf16",)
    with pytest.raises(CostModelInputError, match="drop fp8_fast"):
        ProfileOptions(device="cpu", matmul_dtypes=("bf16", "fp8_fast"))
    assert {"fp8", "fp8_fast"} <= set(ProfileOptions(device="cuda").resolved().matmul_dtypes)
    assert _with_fp8_where_supported(cpu, ("bf16", "fp8_fast", "fp8")) == ("bf16",)
    for fast in (False, True):  # the cases themselves (torch has a CPU _scaled_mm)
        output = _scaled_mm_case(32, cpu, fast_accumulation=fast)()
        assert output.shape == (32, 32) and output.dtype == torch.bfloat16


def test_a_measured_fp8_sweep_prices_the_float8_matmuls():
    from cost_model.compute import ComputeModel
    from cost_model.profile import SCHEMA_VERSION, HardwareProfile, MatmulPoint

    assert not ComputeModel(H100_SXM).measured("fp8")
    points = tuple(MatmulPoint(dtype=dtype, flops=flops, achieved_flops_per_s=rate)
                   for dtype, rate in (("bf16", 600e12), ("fp8", 1100e12)) for flops in (1e9, 1e12))
    profile = HardwareProfile(schema_version=SCHEMA_VERSION, device_name="H100", device_kind="cuda", num_processes=1,
                              memory_bytes=80e9, matmul=points, memory_bandwidth_bytes_per_s=3e12,
                              kernel_overhead_s=5e-6)
    compute = ComputeModel(H100_SXM, profile)
    assert compute.measured("fp8") and compute.matmul_rate(1e12, "fp8") == pytest.approx(1100e12)
    # a profile without the fast-accumulation sweep prices those matmuls at the float8 (split) rate
    assert not compute.measured("fp8_fast") and compute.matmul_rate(1e12, "fp8_fast") == pytest.approx(1100e12)
    fast = tuple(MatmulPoint(dtype="fp8_fast", flops=flops, achieved_flops_per_s=1300e12) for flops in (1e9, 1e12))
    compute = ComputeModel(H100_SXM, replace(profile, matmul=points + fast))
    assert compute.matmul_rate(1e12, "fp8_fast") == pytest.approx(1300e12)
    assert compute.matmul_rate(1e12, "fp8") == pytest.approx(1100e12)


def test_compiled_casts_are_an_amax_pass_and_a_cast_pass():
    compiled = fp8.HANDLINGS["compiled"]
    # amax reduction reads the bf16 source (2), the fused scale-and-cast reads it again and writes 1.
    assert compiled.bytes_per_element(2) == 5 and compiled.kernels(2) == 2
    assert compiled.bytes_per_element(4) == 9  # an fp32 master shard before FSDP2's float8 gather
    assert fp8.HANDLINGS["eager"].bytes_per_element(2) == fp8.cast_bytes_per_element(2) == 33
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    # Compilation fuses passes, not casts: the same six operands are cast.
    assert fp8.cast_elements(linear, weight_precast=False, handling=compiled) == \
        fp8.cast_elements(linear, weight_precast=False)
    assert fp8.num_casts(weight_precast=False, handling=compiled) == 6


def test_transformer_engine_casts_in_one_pass_with_the_transpose_and_weights_once_per_step():
    te = fp8.HANDLINGS["te"]
    assert te.bytes_per_element(2) == 2 + 2 and te.kernels(2) == 1  # read bf16, write two float8 layouts
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    # Per microbatch: the input and grad_output once each; the weight is cast once per step.
    assert fp8.cast_elements(linear, weight_precast=False, handling=te) == 10 + 20
    assert fp8.num_casts(weight_precast=False, handling=te) == 2
    assert fp8.weight_casts_per_step(te) == 1 and fp8.weight_casts_per_step(fp8.HANDLINGS["eager"]) == 0
    assert not te.float8_all_gather and te.amax_reduced_per_region
    eager = fp8.cast_time_s(1e9, 6, source_bytes=2, bandwidth_bytes_per_s=3e12, kernel_overhead_s=5e-6)
    assert fp8.cast_time_s(1e9, 6, source_bytes=2, bandwidth_bytes_per_s=3e12, kernel_overhead_s=5e-6,
                           handling=te) < eager / 8


def test_transformer_engine_current_scaling_casts_in_two_passes_except_after_a_norm():
    """TE's current scaling (Megatron-Bridge's fp8_cs): each cast computes its amax first (read h),
    then casts with the transpose (read h, write 2); a norm-fed input's amax comes from the norm
    kernel (one pass). Weights once per step, float8 inputs saved, fused linears cast once."""
    current, delayed = fp8.HANDLINGS["te-current"], fp8.HANDLINGS["te"]
    assert current.bytes_per_element(2) == 2 * 2 + 2 and current.kernels(2) == 2
    assert current.norm_fused_amax and not current.norm_fused_input_cast and delayed.norm_fused_input_cast
    assert not current.amax_reduced_per_region and delayed.amax_reduced_per_region
    assert current.tp_input_gather_in_float8 and current.shared_input_cast_once and delayed.shared_input_cast_once
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    assert fp8.cast_elements(linear, weight_precast=False, handling=current) == 10 + 20
    assert fp8.cast_counts(current) == fp8.cast_counts(delayed) == {"input": 1, "weight": 1, "grad_output": 1}
    assert fp8.cast_counts(None) == {"input": 2, "weight": 2, "grad_output": 2}  # torchao: six casts per linear


def test_compiled_tensorwise_casts_share_what_the_joint_graph_shares():
    """Compiled as one forward-backward graph, the tensorwise recipe's identical casts are one:
    grad_output once, and the backward's weight cast a cast pass with the forward's scale (no
    amax); the rowwise recipe's casts differ by axis, all six run; eager shares nothing."""
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    tensorwise = fp8.HANDLINGS["compiled"].for_recipe("tensorwise")
    assert fp8.cast_counts(tensorwise) == {"input": 2, "weight": 2, "grad_output": 1}
    assert fp8.amax_counts(tensorwise) == {"input": 2, "weight": 1, "grad_output": 1}
    assert tensorwise.weight_recast_pass_only
    assert fp8.HANDLINGS["compiled"].for_recipe("rowwise") == fp8.HANDLINGS["compiled"]
    eager = fp8.HANDLINGS["eager"].for_recipe("tensorwise")
    assert fp8.cast_counts(eager) == fp8.cast_counts(fp8.HANDLINGS["eager"]) and not eager.weight_recast_pass_only
    assert fp8.cast_elements(linear, weight_precast=True, handling=tensorwise) == 2 * 10 + 20


def test_rowwise_backward_matmuls_rescale_their_outputs_apart():
    """torchao runs rowwise's backward matmuls with unit scales and multiplies each output by the
    outer product of the scales afterwards: eager materializes the fp32 product (12 bytes per output
    element, two kernels), compiled one pass (4 bytes); torchtitan's whole-block compile folds a
    grad_input's pass into its consumer unless an extern kernel (attention, a matmul) takes it; the
    tensorwise recipe and TransformerEngine scale inside the GEMM."""
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)

    def rescale(name, recipe="rowwise", apart=True):
        """The grad_weight's pass, and the grad_input's where it runs `apart`."""
        handling = fp8.HANDLINGS[name].for_recipe(recipe)
        outputs = (linear.weight, linear.input) if apart else (linear.weight,)
        return sum(handling.rescale_pass_s(elements, bandwidth_bytes_per_s=1.0, kernel_overhead_s=0.5)
                   for elements in outputs)

    assert rescale("eager") == 12 * (100 + 10) + 2 * 2 * 0.5
    assert rescale("compiled") == 4 * (100 + 10) + 2 * 0.5
    assert rescale("torchtitan", apart=False) == 4 * 100 + 0.5  # the grad_weight's pass only
    assert fp8.HANDLINGS["torchtitan"].rescale_fused_into_consumers
    assert not fp8.HANDLINGS["compiled"].rescale_fused_into_consumers  # each linear its own graph
    assert rescale("compiled", recipe="tensorwise") == rescale("eager", recipe="tensorwise") == 0.0
    assert rescale("te") == rescale("te-current") == 0.0


def test_torchtitan_before_2025_saved_its_float8_operands():
    """torchao's tensorwise linear before 2025-01-13 cast input and weight in forward, saved the
    float8 copies and cast grad_output once in backward, laying out the saved input and weight
    again for the backward's matmuls (a copy each) and grad_output's second layout in its cast."""
    old = fp8.HANDLINGS["torchtitan-2024"].for_recipe("tensorwise")
    assert fp8.cast_counts(old) == {"input": 1, "weight": 1, "grad_output": 1}
    assert old.saves_float8_inputs and old.shared_input_cast_once and old.tp_input_gather_in_float8
    linear = fp8.Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    copies = fp8.layout_copy_time_s(linear, old, input_shared=False, bandwidth_bytes_per_s=1.0, kernel_overhead_s=0.5)
    assert copies == 2 * 10 + 2 * 100 + 20 + 2 * 0.5  # two copies (a kernel each), one fused second layout
    shared = fp8.layout_copy_time_s(linear, old, input_shared=True, bandwidth_bytes_per_s=1.0, kernel_overhead_s=0.5)
    assert shared == copies - 2 * 10 - 0.5
    assert fp8.layout_copy_time_s(linear, fp8.HANDLINGS["te"], input_shared=False, bandwidth_bytes_per_s=1.0,
                                  kernel_overhead_s=0.5) == 0.0  # TE's casts write both layouts

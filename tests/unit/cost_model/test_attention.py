"""Documented fused attention rates (cost_model/attention.py) and the device that names its kernel."""

from dataclasses import replace

import pytest

from autopar.cluster import Cluster
from cost_model.attention import HOPPER_ATTENTION_KERNELS, AttentionKernel, work_fraction


def _kernel(name: str) -> AttentionKernel:
    return next(kernel for kernel in HOPPER_ATTENTION_KERNELS if kernel.name == name)


def test_flash2_reaches_under_a_third_of_the_h100_peak_and_cudnn_more() -> None:
    flash2, cudnn = _kernel("flash2"), _kernel("cudnn")
    assert flash2.efficiency("forward", False) == pytest.approx(369.9 / 989.4)
    assert flash2.efficiency("forward", True) == pytest.approx(284.1 / 989.4)
    assert flash2.efficiency("backward", False) == pytest.approx(290.6 / 989.4)
    assert flash2.efficiency("backward", True) == pytest.approx(287.1 / 989.4)
    for phase in ("forward", "backward"):
        for causal in (True, False):
            assert flash2.efficiency(phase, causal) < 0.38
            assert cudnn.efficiency(phase, causal) > 1.5 * flash2.efficiency(phase, causal)


def test_cudnns_causal_backward_takes_the_forwards_causal_ratio() -> None:
    cudnn = _kernel("cudnn")
    assert cudnn.backward_causal / cudnn.backward == pytest.approx(cudnn.forward_causal / cudnn.forward)


def test_a_smaller_head_dim_runs_at_the_figures_ratio_and_interpolates_to_128() -> None:
    cudnn = _kernel("cudnn")
    assert cudnn.efficiency("forward", False, 64) == pytest.approx(cudnn.forward * 413 / 595)
    assert cudnn.efficiency("forward", True, 64) == pytest.approx(cudnn.forward_causal * 388 / 539)
    assert cudnn.efficiency("backward", True, 64) == pytest.approx(cudnn.backward_causal * 433 / 516)
    assert cudnn.efficiency("backward", False, 96) == pytest.approx(cudnn.backward * (433 / 516 + 1) / 2)
    assert cudnn.efficiency("forward", False, 32) == cudnn.efficiency("forward", False, 64)
    for head_dim in (0, 128, 192, 256):
        assert cudnn.efficiency("forward", False, head_dim) == cudnn.forward
    with pytest.raises(ValueError, match="head_dim_64 must be"):
        AttentionKernel(name="x", forward=0.3, forward_causal=0.3, backward=0.3, backward_causal=0.3,
                        head_dim_64=(1.2, 1.0, 1.0))


def test_dropout_slows_a_fused_kernel_by_the_measured_ratios() -> None:
    """Measured on one H200 (cuDNN through SDPA, seq 2048, dropout 0.1): 13.14 ms forward against 6.81
    priced without dropout, 27.01 backward against 21.04; documented rates and sweeps alike."""
    from cost_model.attention import dropout_slowdown
    from cost_model.compute import ComputeModel

    assert dropout_slowdown("forward", True) == pytest.approx(1.93, abs=0.01)
    assert dropout_slowdown("backward", True) == pytest.approx(1.28, abs=0.01)
    assert dropout_slowdown("forward", False) == dropout_slowdown("backward", False) == 1.0
    h100 = Cluster.from_spec("dgx-h100:gpus_per_node=1")
    compute = ComputeModel(replace(h100.device, attention_kernel="cudnn"), None)
    for phase, name in (("forward", "aten._scaled_dot_product_cudnn_attention.default"),
                        ("backward", "aten._scaled_dot_product_cudnn_attention_backward.default")):
        plain = compute.kernel(1e12, 1e6, True, name=name, causal=True, head_dim=128)
        dropped = compute.kernel(1e12, 1e6, True, name=name, causal=True, head_dim=128, dropout=True)
        assert dropped.matmul_s == pytest.approx(plain.matmul_s * dropout_slowdown(phase, True))
    matmul = compute.kernel(1e12, 1e6, True, name="aten.mm.default", dropout=True)
    assert matmul.matmul_s == compute.kernel(1e12, 1e6, True, name="aten.mm.default").matmul_s


def test_dropout_slows_a_fused_kernel_priced_as_a_matmul_too() -> None:
    """A device that names no attention kernel prices a fused one as a matmul of torch's count (the
    published Megatron and NeMo rows: Transformer Engine's kernel, unnamed): its dropout draws a
    random number per score all the same."""
    from cost_model.attention import dropout_slowdown
    from cost_model.compute import ComputeModel

    compute = ComputeModel(Cluster.from_spec("dgx-h100:gpus_per_node=1").device, None)
    assert compute.device.attention is None
    for phase, name in (("forward", "aten._scaled_dot_product_flash_attention.default"),
                        ("backward", "aten._scaled_dot_product_flash_attention_backward.default")):
        plain = compute.kernel(1e12, 1e6, True, name=name, causal=True)
        dropped = compute.kernel(1e12, 1e6, True, name=name, causal=True, dropout=True)
        assert plain.matmul_s == pytest.approx(1e12 / compute.matmul_rate(1e12, "bfloat16"))
        assert dropped.matmul_s == pytest.approx(plain.matmul_s * dropout_slowdown(phase, True))


def test_a_causal_kernel_does_half_of_torchs_count() -> None:
    assert work_fraction(True) == 0.5 and work_fraction(False) == 1.0


def test_rates_outside_zero_to_one_and_unknown_phases_are_refused() -> None:
    with pytest.raises(ValueError, match="forward must be in"):
        AttentionKernel(name="x", forward=1.2, forward_causal=0.3, backward=0.3, backward_causal=0.3)
    with pytest.raises(ValueError, match="unknown attention phase"):
        _kernel("flash2").efficiency("sideways", False)


def test_hopper_presets_document_the_kernels_and_name_none_by_default() -> None:
    for preset in ("dgx-h100", "hgx-h200"):
        device = Cluster.from_spec(preset).device
        assert {kernel.name for kernel in device.attention_kernels} == {"flash2", "cudnn"}
        assert device.attention is None
        assert replace(device, attention_kernel="flash2").attention.name == "flash2"


def test_a_kernel_the_device_does_not_document_is_refused() -> None:
    a100 = Cluster.from_spec("dgx-a100-80g").device
    with pytest.raises(ValueError, match="no documented rates"):
        replace(a100, attention_kernel="flash2")

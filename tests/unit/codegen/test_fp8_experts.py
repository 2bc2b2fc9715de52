"""Float8 expert grouped matmuls (codegen/fp8_experts.py): the emulated recipe is torchao's."""

from __future__ import annotations

import pytest
import torch

from autopar.codegen.fp8_experts import EmulatedFloat8GroupedMM, _Gather, _padding, _Spread


def _operands(rows: int = 40, experts: int = 4, k: int = 32, n: int = 48):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    tokens[3] *= 50.0  # one row's scale far from the others': a per-tensor scale would flatten the rest
    weight = (torch.randn(experts, k, n, generator=generator) * 0.1).to(torch.bfloat16)
    offs = torch.tensor([7, 7, 30, 37], dtype=torch.int32)  # an empty expert, 3 rows past the last offset
    grad = torch.randn(rows, n, generator=generator).to(torch.bfloat16)
    return tokens, weight, offs, grad


def _torchao_reference(tokens, weight, offs, grad):
    """The same products from torchao's own reference quantizers of the FP8 rowwise grouped GEMM
    (torchao/prototype/moe_training/utils.py), dequantized and multiplied in float32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (torch_to_3d_rowwise_float8_transpose_rhs,
                                                      torch_to_float8_per_group_colwise)

    fp8 = torch.float8_e4m3fn

    def rowwise(value, dim):
        scale = tensor_to_scale(value, fp8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                round_scales_to_power_of_2=True)
        return to_fp8_saturated(value.float() * scale, fp8).float() / scale

    column_major = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    weight_t, weight_t_scales = torch_to_3d_rowwise_float8_transpose_rhs(column_major, fp8, True)  # [E, N, K]
    weight_for_grad = (weight_t.float() / weight_t_scales).transpose(-2, -1)  # [E, K, N]
    output, grad_tokens = torch.zeros(tokens.shape[0], weight.shape[2]), torch.zeros(tokens.shape)
    grad_weight = torch.zeros(weight.shape)
    rows, experts, grads = rowwise(tokens, -1), rowwise(weight, -2), rowwise(grad, -1)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end == start:  # torchao's reference helper takes no empty group
            continue
        output[start:end] = rows[start:end] @ experts[expert]
        grad_tokens[start:end] = grads[start:end] @ weight_for_grad[expert].t()
        group = torch.tensor([end - start], dtype=torch.int32)
        tokens_q, tokens_s = torch_to_float8_per_group_colwise(tokens[start:end], group, fp8, True)
        grad_q, grad_s = torch_to_float8_per_group_colwise(grad[start:end], group, fp8, True)
        grad_weight[expert] = (tokens_q.float() / tokens_s).t() @ (grad_q.float() / grad_s)
        start = end
    return output, grad_tokens, grad_weight


def test_emulated_grouped_mm_is_torchaos_rowwise_recipe():
    tokens, weight, offs, grad = _operands()
    tokens.requires_grad_(), weight.requires_grad_()
    output = EmulatedFloat8GroupedMM.apply(tokens, weight, offs, torch.bfloat16)
    output.backward(grad)
    assert output.dtype == torch.bfloat16
    expected = _torchao_reference(tokens.detach(), weight.detach(), offs, grad)
    for got, want in zip((output, tokens.grad, weight.grad), expected):
        assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert not output[37:].any() and not tokens.grad[37:].any()  # rows past offs[-1]
    # float8, not bf16: e4m3's rounding is visible against the bf16 grouped matmul
    from autopar.models.grouped_mm import grouped_mm

    bf16 = grouped_mm(tokens.detach().float(), weight.detach().float(), offs)
    output = output.detach()
    error = float((output.float() - bf16).norm() / bf16.norm())
    assert 1e-3 < error < 0.1, error


def test_padding_moves_each_group_to_a_multiple_of_16_and_back():
    offs = torch.tensor([3, 3, 20, 21], dtype=torch.int32)
    padded_offs, positions, padding = _padding(offs)
    assert padded_offs.tolist() == [16, 16, 48, 64]
    assert positions.tolist()[:4] == [0, 1, 2, 16] and positions.tolist()[-1] == 48
    rows = torch.randn(21, 8, requires_grad=True)
    spread = _Spread.apply(rows, positions, padding, 64)
    assert not spread[padding].any()
    back = _Gather.apply(spread * 3.0, positions, padding)
    assert torch.equal(back, rows * 3.0)
    back.sum().backward()
    assert torch.equal(rows.grad, torch.full((21, 8), 3.0))


@pytest.mark.parametrize("shape, reason", [((4, 40, 64), "multiples of 16"), ((64, 64), "2-D weight")])
def test_shapes_torchao_cannot_run_stay_bf16(shape, reason):
    from autopar.codegen.fp8_experts import _shape_blocker

    assert reason in _shape_blocker(torch.empty(shape))
    assert _shape_blocker(torch.empty(4, 32, 64)) == ""


def test_the_cuda_path_pads_groups_and_saves_the_weight_not_its_column_major_copy(monkeypatch):
    """torchao_grouped_mm around a stand-in for torchao's Function (its kernels are CUDA only):
    it gets rows padded per expert to 16 and a column-major weight, and what it saves for the
    backward is a fresh copy of the weight, not the forward's (no weight-sized tensor kept)."""
    import torchao.prototype.moe_training.utils as torchao_utils

    from autopar.codegen.fp8_experts import torchao_grouped_mm
    from autopar.models.grouped_mm import grouped_mm

    seen = {}

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, weight_t, offs):
            # the forward's copy held here: its memory cannot be reused by the backward's
            seen.update(offs=offs.tolist(), strides=weight_t.stride(), forward=weight_t,
                        forwards=seen.get("forwards", 0) + 1)
            ctx.save_for_backward(rows, weight_t, offs)
            return grouped_mm(rows, weight_t.contiguous(), offs)

        @staticmethod
        def backward(ctx, grad):
            rows, weight_t, offs = ctx.saved_tensors
            seen["backward_ptr"] = weight_t.data_ptr()
            grad_rows, grad_weight = torch.ops.autopar.grouped_mm_backward(rows, weight_t.contiguous(), offs, grad)
            return grad_rows, grad_weight, None

    monkeypatch.setattr(torchao_utils, "_quantize_then_scaled_grouped_mm",
                        lambda rows, weight_t, config, offs: StandIn.apply(rows, weight_t, offs))
    tokens, weight, offs, grad = _operands()
    plain = [value.clone().requires_grad_() for value in (tokens, weight)]
    expected = grouped_mm(plain[0], plain[1], offs)
    expected.backward(grad)
    for recomputed in (False, True):  # and inside a checkpointed (recomputed) region, whose hooks it keeps
        seen["forwards"] = 0
        operands = [value.clone().requires_grad_() for value in (tokens, weight)]
        if recomputed:
            from torch.utils.checkpoint import checkpoint

            output = checkpoint(torchao_grouped_mm, *operands, offs, use_reentrant=False)
        else:
            output = torchao_grouped_mm(*operands, offs)
        output.backward(grad)
        k, n = weight.shape[1], weight.shape[2]
        assert seen["offs"] == [16, 16, 48, 64] and seen["strides"] == (k * n, 1, k)
        assert seen["backward_ptr"] != seen["forward"].data_ptr()
        assert seen["forwards"] == (2 if recomputed else 1)  # the region ran again for the backward
        for got, want in ((output, expected), (operands[0].grad, plain[0].grad), (operands[1].grad, plain[1].grad)):
            assert torch.equal(got, want), recomputed

"""probe.py: ops priced and their saved tensors as the CUDA kernels keep them.

`rms_norm` is CUDA's fused kernel (its input and a float32 1 / rms per row kept, not float32
copies of the activations); sdpa with `enable_gqa` keeps K and V at their own head count."""

import torch

from autopar.graph import Ref
from autopar.capture.probe import InputSpec, probe_op

aten = torch.ops.aten


def _spec(shape, dtype=torch.bfloat16, *, param=False) -> InputSpec:
    stride = torch.empty(shape, device="meta").stride()
    return InputSpec(shape=tuple(shape), stride=stride, dtype=dtype, requires_grad=True, is_param=param)


def _bytes(shape, dtype=torch.bfloat16) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def test_rms_norm_is_the_fused_kernel_keeping_its_input_and_one_float_per_row():
    result = probe_op(aten.rms_norm.default, (Ref(index=0), [64], Ref(index=1), 1e-5), {},
                      [_spec((2, 8, 64)), _spec((64,), param=True)])
    assert result.saved_inputs == (0,) and not result.saved_output
    assert result.saved_extra_bytes == 2 * 8 * 4  # rstd, float32, one per row
    assert [kernel.name for kernel in result.fwd_kernels] == ["aten._fused_rms_norm.default"]
    (forward,) = result.fwd_kernels
    assert forward.io_bytes == 2 * _bytes((2, 8, 64)) + _bytes((64,)) + 2 * 8 * 4  # one pass
    assert any("_fused_rms_norm_backward" in kernel.name for kernel in result.bwd_kernels)


def test_rms_norm_with_a_float32_weight_on_bfloat16_input_is_the_composite():
    result = probe_op(aten.rms_norm.default, (Ref(index=0), [64], Ref(index=1), 1e-5), {},
                      [_spec((2, 8, 64)), _spec((64,), torch.float32, param=True)])
    assert len(result.fwd_kernels) > 1 and result.saved_extra_bytes > 2 * 8 * 4


def test_grouped_query_attention_keeps_key_and_value_at_their_own_head_count():
    query, kv = (2, 16, 128, 64), (2, 2, 128, 64)
    args = (Ref(index=0), Ref(index=1), Ref(index=2))
    grouped = probe_op(aten.scaled_dot_product_attention.default, args, {"is_causal": True, "enable_gqa": True},
                       [_spec(query), _spec(kv), _spec(kv)])
    assert grouped.saved_inputs == (0, 1, 2) and grouped.saved_output
    log_sum_exp = 2 * 16 * 128 * 4  # float32, per query row (plus the kernel's few bytes of rng state)
    assert log_sum_exp <= grouped.saved_extra_bytes <= log_sum_exp + 64
    repeated = probe_op(aten.scaled_dot_product_attention.default, args, {"is_causal": True},
                        [_spec(query), _spec(query), _spec(query)])
    flops = lambda result: sum(kernel.flops for kernel in result.fwd_kernels + result.bwd_kernels)  # noqa: E731
    assert flops(grouped) == flops(repeated)  # each query head still attends to a whole K


def test_grouped_query_attention_flops_do_not_depend_on_torchs_counter(monkeypatch):
    """torch before 2.13 asserted equal head counts in its sdpa FLOP formulas; the probe then
    priced GQA attention by its bytes alone. The probe counts attention itself, as torch 2.13 does."""
    from torch.utils import flop_counter

    query, kv = (2, 16, 128, 64), (2, 2, 128, 64)
    args = (Ref(index=0), Ref(index=1), Ref(index=2))
    call = lambda: probe_op(aten.scaled_dot_product_attention.default, args,  # noqa: E731
                            {"is_causal": True, "enable_gqa": True}, [_spec(query), _spec(kv), _spec(kv)])
    counted = call()

    def equal_heads_only(*shapes, **_):
        raise AssertionError("h == _h2")  # torch 2.11's sdpa_flop_count on GQA shapes

    for packet in (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward):
        monkeypatch.setitem(flop_counter.flop_registry, packet, equal_heads_only)
    old_torch = call()
    pairs = 2 * 16 * 128 * 128
    for result in (counted, old_torch):
        (forward,) = [k for k in result.fwd_kernels if "flash_attention" in k.name]
        (backward,) = [k for k in result.bwd_kernels if "flash_attention" in k.name]
        assert forward.is_matmul and forward.flops == 2 * (2 * pairs * 64)
        assert backward.is_matmul and backward.flops == 5 * (2 * pairs * 64)


def test_attention_kernels_carry_their_causal_mask():
    shape = (1, 4, 64, 32)
    args = (Ref(index=0), Ref(index=1), Ref(index=2))
    for causal in (True, False):
        result = probe_op(aten.scaled_dot_product_attention.default, args, {"is_causal": causal},
                          [_spec(shape), _spec(shape), _spec(shape)])
        attention = [k for k in result.fwd_kernels + result.bwd_kernels if "attention" in k.name]
        assert len(attention) == 2 and all(kernel.causal == causal for kernel in attention)
        assert not any(kernel.causal for kernel in result.fwd_kernels + result.bwd_kernels if kernel not in attention)
        assert {kernel.head_dim for kernel in attention} == {shape[-1]}
        assert not any(kernel.head_dim for kernel in result.fwd_kernels + result.bwd_kernels if kernel not in attention)


def test_attention_kernels_carry_their_dropout():
    shape = (1, 4, 64, 32)
    args = (Ref(index=0), Ref(index=1), Ref(index=2))
    for dropout_p in (0.1, 0.0):
        result = probe_op(aten.scaled_dot_product_attention.default, args, {"dropout_p": dropout_p},
                          [_spec(shape), _spec(shape), _spec(shape)])
        attention = [k for k in result.fwd_kernels + result.bwd_kernels if "attention" in k.name]
        assert len(attention) == 2 and all(kernel.dropout == (dropout_p > 0) for kernel in attention)
        assert not any(kernel.dropout for kernel in result.fwd_kernels + result.bwd_kernels if kernel not in attention)


def test_masked_fill_runs_as_a_copy_then_the_fill_in_place():
    """ATen's out-of-place masked_fill clones `self` and fills the copy: forward and backward
    (grad.masked_fill(mask, 0)) each read and write the whole tensor twice."""
    scores, mask = (2, 4, 16, 16), (16, 16)
    masked = probe_op(aten.masked_fill.Scalar, (Ref(index=0), Ref(index=1), -1e4), {},
                      [_spec(scores), InputSpec(shape=mask, stride=(16, 1), dtype=torch.bool, requires_grad=False,
                                                is_param=False)])
    nbytes = 2 * 4 * 16 * 16 * 2  # bf16
    for kernels in (masked.fwd_kernels, masked.bwd_kernels):
        assert [k.name for k in kernels] == ["aten.clone.default", "aten.masked_fill.Scalar"]
        assert kernels[0].io_bytes == 2 * nbytes and not kernels[0].broadcast
    where = probe_op(aten.where.self, (Ref(index=1), Ref(index=0), Ref(index=2)), {},
                     [_spec(scores), InputSpec(shape=mask, stride=(16, 1), dtype=torch.bool, requires_grad=False,
                                               is_param=False), _spec(())])
    assert [k.name for k in where.fwd_kernels] == ["aten.where.self"]


def test_pointwise_kernels_with_a_broadcast_operand_are_marked():
    scores, mask = (2, 4, 16, 16), (16, 16)
    masked = probe_op(aten.masked_fill.Scalar, (Ref(index=0), Ref(index=1), -1e4), {},
                      [_spec(scores), InputSpec(shape=mask, stride=(16, 1), dtype=torch.bool, requires_grad=False,
                                                is_param=False)])
    fill = [k for k in masked.fwd_kernels if "masked_fill" in k.name]
    assert [k.broadcast for k in fill] == [True]
    assert all(k.broadcast for k in masked.bwd_kernels if "masked_fill" in k.name)
    same = probe_op(aten.mul.Tensor, (Ref(index=0), Ref(index=1)), {}, [_spec(scores), _spec(scores)])
    scalar = probe_op(aten.mul.Tensor, (Ref(index=0), 0.5), {}, [_spec(scores)])
    gelu = probe_op(aten.gelu.default, (Ref(index=0),), {}, [_spec(scores)])
    assert not any(k.broadcast for result in (same, scalar, gelu) for k in result.fwd_kernels + result.bwd_kernels)


def test_grouped_mm_backward_counts_the_weight_gradient_as_a_grouped_matmul():
    """aten._grouped_mm's backward is two grouped matmuls: the token gradient ([S, N] x [e, N, K])
    and the weight gradient ([K, S] x [S, N] -> [e, K, N], both operands 2-D): each 2 S K N."""
    offsets = InputSpec(shape=(8,), stride=(1,), dtype=torch.int32, requires_grad=False, is_param=False)
    result = probe_op(aten._grouped_mm.default, (Ref(index=0), Ref(index=1), Ref(index=2)), {},
                      [_spec((128, 64)), _spec((8, 64, 256), param=True), offsets])
    flops = 2.0 * 128 * 64 * 256
    assert [kernel.flops for kernel in result.fwd_kernels] == [flops]
    assert [kernel.flops for kernel in result.bwd_kernels if kernel.is_matmul] == [flops, flops]


def test_grouped_mm_kernels_name_their_per_expert_bytes():
    """Expert parallelism divides a grouped matmul's 3-D operands (the weights, the weight
    gradient) among ranks, not its rows: each kernel records those bytes apart."""
    offsets = InputSpec(shape=(8,), stride=(1,), dtype=torch.int32, requires_grad=False, is_param=False)
    result = probe_op(aten._grouped_mm.default, (Ref(index=0), Ref(index=1), Ref(index=2)), {},
                      [_spec((128, 64)), _spec((8, 64, 256), param=True), offsets])
    weight = _bytes((8, 64, 256))
    assert [kernel.expert_bytes for kernel in result.fwd_kernels] == [weight]
    assert sorted(kernel.expert_bytes for kernel in result.bwd_kernels if kernel.is_matmul) == [weight, weight]
    assert all(kernel.io_bytes > kernel.expert_bytes for kernel in result.fwd_kernels + result.bwd_kernels
               if kernel.is_matmul)
    assert all(kernel.expert_bytes == 0 for kernel in
               probe_op(aten.mm.default, (Ref(index=0), Ref(index=1)), {}, [_spec((128, 64)), _spec((64, 32))]
                        ).fwd_kernels)


def test_latent_attention_output_is_laid_out_as_the_query():
    """q, k wider than v (DeepSeek's latent attention: 192 against 128) cannot run CUDA's flash
    kernel; the efficient one does, and its output, like flash's, lies as the query: transposed
    back and flattened for the output projection it is a view, not a second copy kept beside it."""
    batch, heads, seq = 2, 4, 16
    rows_first = lambda dim: InputSpec(  # noqa: E731 - [b, s, h, d] memory seen as [b, h, s, d]
        shape=(batch, heads, seq, dim), stride=(seq * heads * dim, dim, heads * dim, 1), dtype=torch.bfloat16,
        requires_grad=True, is_param=False)
    args = (Ref(index=0), Ref(index=1), Ref(index=2))
    result = probe_op(aten.scaled_dot_product_attention.default, args, {"is_causal": True},
                      [rows_first(24), rows_first(24), rows_first(16)])
    assert [kernel.name for kernel in result.fwd_kernels] == ["aten._scaled_dot_product_efficient_attention.default"]
    (output_strides,) = result.output_strides
    assert output_strides == (seq * heads * 16, 16, heads * 16, 1)
    same = probe_op(aten.scaled_dot_product_attention.default, args, {"is_causal": True},
                    [rows_first(16), rows_first(16), rows_first(16)])
    assert [kernel.name for kernel in same.fwd_kernels] == ["aten._scaled_dot_product_flash_attention.default"]


def test_dispatches_count_every_aten_op_of_forward_and_backward_views_included():
    """What DTensor handles one by one (overheads.py's framework.dtensor_dispatch): a linear on a
    3-d input is views, a transpose and a matmul forward and more backward; a pointwise op one
    each way (and a detach where autograd saves a tensor)."""
    linear = probe_op(aten.linear.default, (Ref(index=0), Ref(index=1)), {},
                      [_spec((2, 8, 64)), _spec((32, 64), param=True)])
    gelu = probe_op(aten.gelu.default, (Ref(index=0),), {}, [_spec((2, 8, 64))])
    assert 2 <= gelu.dispatches <= 3
    assert linear.dispatches >= 3 * gelu.dispatches
    assert linear.dispatches > len(linear.fwd_kernels) + len(linear.bwd_kernels) >= 3
    frozen = probe_op(aten.gelu.default, (Ref(index=0),), {},
                      [InputSpec(shape=(4,), stride=(1,), dtype=torch.float32, requires_grad=False, is_param=False)])
    assert frozen.dispatches == 1  # no backward


def test_attention_also_counts_the_math_kernels_ops_that_dtensor_runs_on_cpu():
    """The fused kernel is one op each way; torch's math kernel in its place (how the runtime runs
    attention on CPU DTensors) is the scores' matmuls, the mask, the softmax and their backward."""
    query, key_value = _spec((2, 4, 16, 8)), _spec((2, 2, 16, 8))
    result = probe_op(aten.scaled_dot_product_attention.default, (Ref(index=0), Ref(index=1), Ref(index=2)),
                      {"is_causal": True, "enable_gqa": True}, [query, key_value, key_value])
    assert result.unfused_dispatches > 4 * result.dispatches > 0
    gelu = probe_op(aten.gelu.default, (Ref(index=0),), {}, [_spec((2, 8, 64))])
    assert gelu.unfused_dispatches == 0


def test_attention_records_the_math_kernels_the_cpu_runtime_computes():
    """Beside the fused kernel, the probe keeps the math path's kernels, forward and backward: the
    scores' and the context's batched matmuls (the same FLOPs as the fused count without a mask),
    the softmax, and their backward."""
    query, key_value = _spec((2, 4, 16, 8)), _spec((2, 4, 16, 8))
    result = probe_op(aten.scaled_dot_product_attention.default, (Ref(index=0), Ref(index=1), Ref(index=2)),
                      {}, [query, key_value, key_value])
    forward = [kernel.name for kernel in result.unfused_fwd_kernels]
    backward = [kernel.name for kernel in result.unfused_bwd_kernels]
    assert forward.count("aten.bmm.default") == 2 and any("softmax" in name for name in forward)
    assert backward.count("aten.bmm.default") == 4 and any("softmax_backward" in name for name in backward)
    fused_flops = sum(kernel.flops for kernel in result.fwd_kernels if kernel.is_matmul)
    math_flops = sum(kernel.flops for kernel in result.unfused_fwd_kernels if kernel.is_matmul)
    assert math_flops == fused_flops > 0
    gelu = probe_op(aten.gelu.default, (Ref(index=0),), {}, [_spec((2, 8, 64))])
    assert gelu.unfused_fwd_kernels == gelu.unfused_bwd_kernels == ()

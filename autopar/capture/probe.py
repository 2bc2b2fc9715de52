"""Run one captured op on meta tensors to learn what it costs and what its backward keeps.

For each op we execute it (and its backward) on `meta` tensors of the captured shapes under a
dispatch mode that records every kernel that would launch: its FLOPs (torch's own flop
formulas for matmul, convolution and attention kernels), the bytes it reads and writes, and
whether it is a view. Autograd's saved-tensor hooks tell exactly which tensors the backward
keeps: an input, the output, or a new tensor (a dropout mask, norm statistics).

Ops run as their CUDA implementation would: dropout as the fused `native_dropout` (1-byte mask),
scaled-dot-product attention as flash/memory-efficient attention (no s x s matrix kept; with
`enable_gqa` the kernel reads K and V at their own head count and keeps them so), and `rms_norm`
as CUDA's fused kernel (`_fused_rms_norm`: one pass that keeps its input and the float32 1 / rms
per row; on the CPU it decomposes into float32 ops that keep float32 copies of the input).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from autopar.capture.attention_flops import attention_dropout, attention_flops, attention_head_dim, is_causal
from autopar.capture.unfused_attention import run_math_attention
from autopar.graph import Kernel, Ref

aten = torch.ops.aten
_FREE_OPS = {
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.detach.default,
    aten.lift_fresh.default, aten.alias.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    # A view whose schema does not say so (matmul/linear reshape their result with it): no kernel.
    aten._unsafe_view.default,
}
_COPY_FIRST_OPS = {aten.masked_fill.Scalar, aten.masked_fill.Tensor}
"""Out-of-place ops that every backend runs as a copy of `self` and then the in-place op over all
of it (ATen's composite `masked_fill`: `self.clone()`, then `masked_fill_`): two kernels, the
copy a device-to-device memcpy (one H200: 24.5 ms of an eager-attention GPT step, BENCHMARKS)."""


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """A tensor input of the op being probed."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_param: bool


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    fwd_kernels: tuple[Kernel, ...]
    bwd_kernels: tuple[Kernel, ...]
    saved_inputs: tuple[int, ...]
    saved_output: bool
    saved_extra_bytes: float
    alias_input: int | None
    requires_grad: bool
    note: str = ""
    output_strides: tuple[tuple[int, ...], ...] = ()
    """Strides of the outputs as the CUDA-equivalent kernels lay them out (empty: unknown)."""
    dispatches: int = 0
    """aten ops the forward and backward dispatched, views and free ops included (OpNode.dispatches)."""
    unfused_dispatches: int = 0
    """A fused attention call: the aten ops of torch's math kernel in its place (OpNode.unfused_dispatches)."""
    unfused_fwd_kernels: tuple[Kernel, ...] = ()
    """A fused attention call: the kernels of torch's math kernel in its place, forward."""
    unfused_bwd_kernels: tuple[Kernel, ...] = ()
    """... and backward (OpNode.unfused_fwd_kernels, unfused_bwd_kernels)."""
    input_grad_strides: tuple[tuple[int, ...] | None, ...] = ()
    """Per input, the strides of the gradient the backward returns for it (None: none returned;
    empty: unknown). A view's backward keeps its incoming gradient's layout, so a gradient that
    arrives transposed leaves transposed, and the reshape that undoes a view then copies it."""

    def node_fields(self) -> dict:
        """The OpNode fields this probe sets (every capture path builds its nodes with them)."""
        return dict(fwd_kernels=self.fwd_kernels, bwd_kernels=self.bwd_kernels, saved_inputs=self.saved_inputs,
                    saved_output=self.saved_output, saved_extra_bytes=self.saved_extra_bytes,
                    alias_input=self.alias_input, requires_grad=self.requires_grad, note=self.note,
                    dispatches=self.dispatches, unfused_dispatches=self.unfused_dispatches,
                    unfused_fwd_kernels=self.unfused_fwd_kernels, unfused_bwd_kernels=self.unfused_bwd_kernels)


def _is_view_op(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _tensor_bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class KernelRecorder(TorchDispatchMode):
    """Records the kernels dispatched while active (views and allocations are free), and counts
    every aten op dispatched (views and allocations too)."""

    active: list[KernelRecorder] = []
    """Recorders entered and not yet exited, innermost last (for kernels emulated in Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []
        self.dispatches = 0

    def __enter__(self):
        KernelRecorder.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        KernelRecorder.active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.dispatches += 1
        if func in _FREE_OPS or _is_view_op(func):
            return out
        if func in _COPY_FIRST_OPS:
            self.kernels.append(_copy_of(out))
        packet = func._overloadpacket
        attention = attention_flops(func, args)
        is_matmul = attention is not None or packet in flop_registry or _is_grouped_mm(func)
        if attention is not None:
            flops = attention
        elif packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif is_matmul:
            flops = _grouped_mm_flops(args)
        else:
            flops = float(sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        io_bytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
        self.kernels.append(Kernel(name=str(func), flops=flops, io_bytes=float(io_bytes), is_matmul=is_matmul,
                                   dtype=_compute_dtype(args, out),
                                   causal=attention is not None and is_causal(func, args, kwargs),
                                   head_dim=attention_head_dim(func, args) if attention is not None else 0,
                                   dropout=attention is not None and attention_dropout(func, args, kwargs) > 0,
                                   broadcast=_broadcasts(func, args, out),
                                   expert_bytes=_expert_bytes(args, out) if _is_grouped_mm(func) else 0.0))
        return out


def _copy_of(tensor: torch.Tensor) -> Kernel:
    """The contiguous copy of a tensor of `tensor`'s size (read it, write it)."""
    return Kernel(name=str(aten.clone.default), flops=float(tensor.numel()), io_bytes=2.0 * _tensor_bytes(tensor),
                  is_matmul=False, dtype=str(tensor.dtype).removeprefix("torch."))


def _broadcasts(func, args, out) -> bool:
    """A pointwise op reading a tensor operand that is smaller than its output but not a scalar."""
    if torch.Tag.pointwise not in func.tags:
        return False
    outputs = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    largest = max(outputs, default=0)
    return any(isinstance(t, torch.Tensor) and 1 < t.numel() < largest for t in tree_flatten(args)[0])


def _is_grouped_mm(func) -> bool:
    """Grouped expert matmuls (MoE): torch's `_grouped_mm` and transformers' fallback op and its
    backward, which torch's FLOP counter does not know."""
    name = str(func)
    return "grouped_mm" in name


def _expert_bytes(args, out) -> float:
    """A grouped matmul's per-expert operands: the 3-D ones ([experts, K, N] weights, the weight
    gradient), where the rows are 2-D ([S, K] tokens, outputs, their gradients)."""
    return float(sum(t.numel() * t.element_size() for t in tree_flatten((args, out))[0]
                     if isinstance(t, torch.Tensor) and t.dim() == 3))


def _grouped_mm_flops(args) -> float:
    """Every row meets one expert: 2 S K N for out[S, N] = in[S, K] @ w[e, K, N], and for the
    weight gradient out[e, K, N] = in[K, S] @ grad[S, N] (both operands 2-D, each expert's rows a
    slice of S: the backward of aten._grouped_mm); transformers' backward op (input, weight,
    offsets, grad_output) does two of those."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    if len(tensors) < 2 or tensors[0].dim() != 2 or tensors[1].dim() not in (2, 3):
        return 0.0
    rows, inner = tensors[0].shape
    flops = 2.0 * rows * inner * tensors[1].shape[-1]
    return 2 * flops if len(tensors) >= 4 and tensors[1].dim() == 3 else flops


def _compute_dtype(args, out) -> str:
    tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else "float32"


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _make_inputs(specs: Sequence[InputSpec]) -> list[torch.Tensor]:
    tensors = []
    for spec in specs:
        tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


def _fill(template, tensors: list[torch.Tensor]):
    return tree_map(lambda item: tensors[item.index] if isinstance(item, Ref) else item, template,
                    is_leaf=lambda item: isinstance(item, Ref))


def _cuda_equivalent(func, args: tuple, kwargs: dict):
    """Swap composite ops for the kernels CUDA runs, so that saved tensors match a GPU."""
    if func is aten.dropout.default:
        x, p, train = args[0], args[1], args[2]
        if train and p > 0:
            return (lambda: aten.native_dropout.default(x, p, True)[0])
    if func is aten.scaled_dot_product_attention.default:
        return _sdpa_kernel(*args, **kwargs)
    if func in (aten.rms_norm.default, aten._fused_rms_norm.default):
        return _fused_rms_norm(func, *args, **kwargs)
    return None


def _fused_rms_norm(func, x, normalized_shape, weight=None, eps=None):
    if weight is not None and weight.dtype != x.dtype:
        return None  # CUDA runs mixed dtypes through the float32 composite too
    normalized_shape = tuple(normalized_shape)
    first = func is aten._fused_rms_norm.default
    return lambda: _FusedRmsNorm.apply(x, weight, normalized_shape, eps, first)


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's `_fused_rms_norm` on meta: one kernel that reads x and the weight and writes y and
    rstd = 1 / rms(x) (float32, one per row); autograd keeps x, rstd and the weight, and the
    backward is `_fused_rms_norm_backward` (derivatives.yaml, torch 2.13)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, both):
        rows = x.shape[:x.dim() - len(normalized_shape)]
        output = torch.empty_like(x)
        rstd = x.new_empty(rows + (1,) * len(normalized_shape), dtype=torch.float32)
        io_bytes = _tensor_bytes((x, weight, output, rstd))
        for recorder in KernelRecorder.active:
            recorder.kernels.append(Kernel(name="aten._fused_rms_norm.default", flops=float(output.numel()),
                                           io_bytes=float(io_bytes), is_matmul=False,
                                           dtype=str(x.dtype).removeprefix("torch.")))
        ctx.save_for_backward(x, rstd, weight)
        ctx.normalized_shape = normalized_shape
        ctx.mark_non_differentiable(rstd)
        return (output, rstd) if both else output

    @staticmethod
    def backward(ctx, grad_output, *unused):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        grad_x, grad_weight = aten._fused_rms_norm_backward.default(grad_output, x, list(ctx.normalized_shape),
                                                                    rstd, weight, mask)
        return grad_x, grad_weight, None, None, None


def _sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # CUDA's flash kernel takes no mask and one head dim for q, k and v (sdp_utils'
    # check_head_dim_size_flash); latent attention's wider q, k (DeepSeek's 192 against v's 128)
    # runs the efficient kernel, whose output, like flash's, is laid out as the query (rows, heads,
    # dim): transposed back and flattened for the output projection it is a view, not a copy.
    # The efficient kernel takes no grouped K/V (torch 2.13 picks flash for GQA, or the math
    # kernel, which repeats K and V itself); flash reads them at their own head count.
    flash = attn_mask is None and query.shape[-1] == key.shape[-1] == value.shape[-1]
    if key.shape[-3] != query.shape[-3] and not (enable_gqa and flash):
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    if flash:
        return lambda: aten._scaled_dot_product_flash_attention.default(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return lambda: aten._scaled_dot_product_efficient_attention.default(
        query, key, value, attn_mask, False, dropout_p, is_causal, scale=scale)[0]


def probe_op(target, args, kwargs: dict, specs: Sequence[InputSpec],
             grad_strides: Sequence[tuple[int, ...]] | None = None) -> ProbeResult:
    """Execute `target(*args, **kwargs)` (with Ref placeholders filled from `specs`) on meta.
    The backward receives gradients laid out like the outputs, or with `grad_strides` (one per
    output that needs a gradient): the layout its consumers' backward really hands it."""
    inputs = _make_inputs(specs)
    call_args, call_kwargs = _fill(tuple(args), inputs), _fill(dict(kwargs), inputs)
    saved: list[torch.Tensor] = []
    forward = _cuda_equivalent(target, call_args, call_kwargs) or (lambda: target(*call_args, **call_kwargs))
    # Under enable_grad, which restores the caller's mode however the op ends: torch's
    # wrap_with_set_grad_enabled (a `with torch.no_grad():` region) leaves grad off if its body fails.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with KernelRecorder() as fwd:
            output = forward()
    out_tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    saved_inputs, saved_output, extra_bytes = _classify_saved(saved, inputs, specs, out_tensors)
    alias_input = _alias_input(inputs, out_tensors)
    requires_grad = any(t.requires_grad for t in out_tensors)
    bwd_kernels: tuple[Kernel, ...] = ()
    grad_strides_out: tuple[tuple[int, ...] | None, ...] = ()
    note = ""
    dispatches = fwd.dispatches
    if requires_grad:
        try:
            kernels, grad_strides_out, backward_dispatches = _backward_kernels(out_tensors, inputs, grad_strides)
            bwd_kernels = tuple(kernels)
            dispatches += backward_dispatches
        except Exception as error:  # an op whose backward has no meta kernel
            note = f"backward not measurable on meta ({type(error).__name__}); priced as 2x forward"
            bwd_kernels = tuple(fwd.kernels) * 2
            dispatches *= 3
    unfused_dispatches, unfused_fwd, unfused_bwd = _unfused(target, call_args, call_kwargs)
    return ProbeResult(fwd_kernels=tuple(fwd.kernels), bwd_kernels=bwd_kernels, saved_inputs=saved_inputs,
                       saved_output=saved_output, saved_extra_bytes=extra_bytes, alias_input=alias_input,
                       requires_grad=requires_grad, note=note, dispatches=dispatches,
                       unfused_dispatches=unfused_dispatches, unfused_fwd_kernels=unfused_fwd,
                       unfused_bwd_kernels=unfused_bwd,
                       output_strides=tuple(tuple(t.stride()) for t in out_tensors),
                       input_grad_strides=grad_strides_out)


def _unfused(target, args: tuple, kwargs: dict) -> tuple[int, tuple[Kernel, ...], tuple[Kernel, ...]]:
    """For scaled_dot_product_attention, the aten ops (forward and backward) and the forward and
    backward kernels of the math kernel in its place (unfused_attention.py); (0, (), ()) else."""
    if target is not aten.scaled_dot_product_attention.default:
        return 0, (), ()
    fwd, bwd = KernelRecorder(), KernelRecorder()
    try:
        run_math_attention(fwd, bwd, *args, **kwargs)
    except Exception:  # noqa: BLE001 - arguments the math kernel refuses: the fused kernel stands
        return 0, (), ()
    return fwd.dispatches + bwd.dispatches, tuple(fwd.kernels), tuple(bwd.kernels)


def _backward_kernels(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                      grad_strides: Sequence[tuple[int, ...]] | None = None
                      ) -> tuple[list[Kernel], tuple[tuple[int, ...] | None, ...], int]:
    diff_outputs = [t for t in outputs if t.requires_grad]
    diff_inputs = [t for t in inputs if t.requires_grad]
    if not diff_inputs:
        return [], (), 0
    if grad_strides is not None and len(grad_strides) == len(diff_outputs):
        grads = [torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
                 for t, stride in zip(diff_outputs, grad_strides)]
    else:
        grads = [torch.empty_like(t) for t in diff_outputs]
    with KernelRecorder() as bwd:
        returned = iter(torch.autograd.grad(diff_outputs, diff_inputs, grads, allow_unused=True))
    grads_by_input = [next(returned) if t.requires_grad else None for t in inputs]
    return bwd.kernels, tuple(None if grad is None else tuple(grad.stride()) for grad in grads_by_input), bwd.dispatches


def _classify_saved(saved, inputs, specs, outputs) -> tuple[tuple[int, ...], bool, float]:
    input_ids = {}
    for index, tensor in enumerate(inputs):
        input_ids.setdefault(_storage_id(tensor), index)
    output_ids = {_storage_id(t) for t in outputs}
    saved_inputs: set[int] = set()
    saved_output = False
    extra_ids: dict[int, int] = {}
    for tensor in saved:
        storage = _storage_id(tensor)
        if storage in input_ids:
            index = input_ids[storage]
            if not specs[index].is_param:
                saved_inputs.add(index)
        elif storage in output_ids:
            saved_output = True
        else:
            extra_ids[storage] = max(extra_ids.get(storage, 0), tensor.untyped_storage().nbytes())
    return tuple(sorted(saved_inputs)), saved_output, float(sum(extra_ids.values()))


def _alias_input(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int | None:
    if not outputs:
        return None
    storage = _storage_id(outputs[0])
    for index, tensor in enumerate(inputs):
        if _storage_id(tensor) == storage:
            return index
    return None


def io_priced(name: str, specs: Sequence[InputSpec], output_bytes: float, error: Exception) -> ProbeResult:
    """For an op that cannot run on meta: one memory-bound kernel over its inputs and outputs,
    all non-parameter inputs kept for backward (conservative)."""
    input_bytes = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs)
    kernel = Kernel(name=name, flops=0.0, io_bytes=float(input_bytes + output_bytes), is_matmul=False)
    grad = any(spec.requires_grad for spec in specs)
    return ProbeResult(fwd_kernels=(kernel,), bwd_kernels=(kernel, kernel) if grad else (), dispatches=3 if grad else 1,
                       saved_inputs=tuple(i for i, spec in enumerate(specs) if not spec.is_param),
                       saved_output=False, saved_extra_bytes=0.0, alias_input=None, requires_grad=grad,
                       note=f"could not run on meta ({type(error).__name__}); priced by its input/output bytes")

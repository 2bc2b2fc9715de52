"""What float8 training adds to and takes from a linear, as torchao 0.18 runs it eagerly.

autopar runs torchao's `matmul_with_hp_or_float8_args` without torch.compile, so every cast is
the eager sequence of torchao's source (float8_utils.tensor_to_amax, amax_to_scale,
float8_training_tensor._ToFloat8ConstrFunc, to_fp8_saturated), each op one kernel:

    amax = max(abs(x))                         abs: read h, write h    max: read h
    scale = fp8_max / clamp(amax, eps)         scalar kernels
    bits = clamp(x.to(fp32) * scale).to(fp8)   to: read h, write 4 (none from fp32)
                                               mul: read 4, write 4    clamp: read 4, write 4
                                               to: read 4, write 1

so a cast moves 4h + 25 bytes per element from an h-byte source (33 from bf16; from fp32 the
`.to(fp32)` is no copy: 3h + 21 = 33). A linear casts six operands per microbatch: the input and
the weight for the forward matmul; in backward grad_output twice (for grad_input and for
grad_weight, each with its own call), the weight again (grad_input) and the input again
(grad_weight) (`matmul_with_hp_or_float8_args.backward`). A weight FSDP2 gathers in float8
(WeightWithDynamicFloat8CastTensor) arrives cast: its two casts move to its shard before the
all-gather, from fp32. Matmuls run at the device's "fp8" peak (FP8 tensor cores; a measured bf16
rate is scaled by the datasheet's fp8/bf16 ratio); a device without them emulates (dequantised
matmuls at the bf16 rate).

This module does not import autopar or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FP8_BYTES = 1
"""Bytes per float8 element (e4m3, e5m2)."""
SCALE_BYTES = 4
"""One fp32 scale (per tensor, or per row under the rowwise recipe)."""
CAST_ELEMENT_KERNELS = 6
"""abs, max, to(fp32), mul, clamp, to(fp8): element passes of one eager cast (5 from fp32)."""
CAST_SCALAR_KERNELS = 3
"""amax_to_scale on the amax: to(fp64), clamp, divide (then the scale's to(fp32): folded in)."""
FORWARD_CASTS = {"input": 1, "weight": 1}
BACKWARD_CASTS = {"grad_output": 2, "weight": 1, "input": 1}


def cast_bytes_per_element(source_bytes: int) -> float:
    """Bytes an eager torchao cast moves per element of an `source_bytes`-byte tensor."""
    widen = 0 if source_bytes == 4 else source_bytes + 4
    return 2 * source_bytes + source_bytes + widen + 8 + 8 + 4 + FP8_BYTES


def cast_kernels(source_bytes: int) -> int:
    return CAST_ELEMENT_KERNELS - (source_bytes == 4) + CAST_SCALAR_KERNELS


@dataclass(frozen=True, kw_only=True)
class Fp8LinearElements:
    """Elements of one float8 linear's operands on one rank, per microbatch."""

    input: float
    weight: float
    grad_output: float


def cast_elements(linear: Fp8LinearElements, *, weight_precast: bool) -> float:
    """Elements cast per microbatch (forward and backward) from the compute dtype; a weight
    gathered in float8 is not cast here (see weight_shard_cast_bytes)."""
    total = 0.0
    for counts in (FORWARD_CASTS, BACKWARD_CASTS):
        for operand, count in counts.items():
            if operand == "weight" and weight_precast:
                continue
            total += count * getattr(linear, operand)
    return total


def num_casts(*, weight_precast: bool) -> int:
    counts = sum(FORWARD_CASTS.values()) + sum(BACKWARD_CASTS.values())
    return counts - (FORWARD_CASTS["weight"] + BACKWARD_CASTS["weight"] if weight_precast else 0)


def cast_time_s(elements: float, casts: int, *, source_bytes: int, bandwidth_bytes_per_s: float,
                kernel_overhead_s: float) -> float:
    """Eager casts of `elements` elements in `casts` casts."""
    return (elements * cast_bytes_per_element(source_bytes) / bandwidth_bytes_per_s
            + casts * cast_kernels(source_bytes) * kernel_overhead_s)


def all_gather_bytes_saved(weight_numel: float, param_bytes: int) -> float:
    """Bytes per gathered element FSDP2 no longer moves when it gathers a weight in float8
    instead of in the compute dtype (`param_bytes`), times the weight's elements."""
    return weight_numel * (param_bytes - FP8_BYTES)


def transient_bytes(linear: Fp8LinearElements) -> float:
    """The float8 copies alive around one linear's matmuls: the forward's input and weight copies,
    or the backward's two grad_output copies with the weight and input copies (the larger)."""
    forward = linear.input + linear.weight
    backward = 2 * linear.grad_output + linear.weight + linear.input
    return max(forward, backward) * FP8_BYTES

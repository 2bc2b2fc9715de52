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
all-gather, from fp32.

How the casts run is an input (CastHandling, HANDLINGS). "eager" is the sequence above (autopar's
runtime without torch.compile). "compiled" is autopar's runtime with each float8 linear compiled
(codegen/fp8_compile.py): inductor fuses each cast's element passes into an amax reduction (read h)
and one scale-and-cast pass (read h, write 1), 2h + 1 bytes per element in two kernels, and the
forward and backward, compiled as one joint graph, share their identical casts: under tensorwise
scaling grad_output is cast once and the backward's weight cast reuses the forward's scale (a cast
pass), four casts and a pass where eager runs six (rowwise casts differ by axis: all six run); the
plan's tp redistributions stay outside, so sequence-parallel inputs are gathered in bf16.
"torchtitan" is torchao under torch.compile as torchtitan runs it: the same, each transformer block
compiled whole, so linears reading one tensor (q, k, v; gate, up) share its casts, and the
sequence-parallel inputs of column-parallel linears cast on their shard and all-gathered in
float8 (Float8ColwiseParallel). "torchtitan-2024" is torchtitan with torchao before 2025-01-13
(pytorch/ao#1461, #1480): its tensorwise linear cast the input and the weight in forward and saved
the float8 copies for backward, which cast grad_output once, three casts per linear. "te" is TransformerEngine's
per-tensor delayed scaling (Megatron-Core/NeMo): the scale comes from the amax history, so a cast
is one pass that also records the amax and writes the row-major and the transposed float8 copy
the backward reads (read h, write 2); grad_output is cast once (cast-transpose), the forward's
float8 input is kept for the weight gradient (what is saved for backward: 1 byte per element),
each weight is cast once per step (its first microbatch; the float8 weight and its transpose are
kept for the rest: memory `fp8.weights`, two bytes per weight element), and a linear fed by a norm
gets its input in float8 from the norm kernel (LayerNormLinear), no cast, and under sequence
parallelism all-gathers that float8 shard (TE 1.12's layernorm_linear.py gathers the norm's uint8
output; again in backward, where Megatron re-gathers its saved shard); linears that read one
input (Megatron-Core's fused QKV and fc1) cast it once; the amaxes its casts record are
all-reduced together, a model chunk's at the end of its forward and again in its backward, over the
stage's tp x dp x cp ranks; each MoE expert is a float8 linear of its own, cast as one.
"te-current" is TransformerEngine 2.x's
per-tensor current scaling (Float8CurrentScaling, Megatron-Bridge's "fp8_cs"): the scale comes from
the tensor itself, so a cast is an amax pass and a cast-transpose pass (read h twice, write 2),
except after a norm, whose kernel writes the amax beside its bf16 output (one cast pass); the amax
of a sequence-parallel input (column-parallel) or grad_output (row-parallel) is all-reduced over
the tp group before its cast (TE's amax_reduction_group, one per cast); the input cast on its
sequence shard and all-gathered in float8, weights, saved inputs, the fused linears and the experts
as under "te" (no amax history: nothing reduced at a region's end).

Under the rowwise recipe torchao runs each backward matmul with unit scales and multiplies its
output by the scales afterwards (`CastHandling.rowwise_rescale_bytes`), a pass of its own where
no pointwise kernel takes it in.

Matmuls run at the bf16 rate times the device's float8 speed-up (FP8 tensor cores: the peaks' ratio
times its documented fp8_matmul_efficiency); a device without them emulates (dequantised matmuls at
the bf16 rate). Where a profile measured float8 matmuls, each of a linear's three runs at
the rate of its accumulation (FAST_ACCUMULATION_MATMULS).

This module does not import autopar or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FP8_BYTES = 1
"""Bytes per float8 element (e4m3, e5m2)."""
SCALE_BYTES = 4
"""One fp32 scale (per tensor, or per row under the rowwise recipe)."""
FAST_ACCUMULATION_MATMULS = ("output",)
"""The matmuls of a float8 linear that run with fast accumulation: the forward one only. torchao's
Float8LinearConfig sets use_fast_accum on its output GEMM and leaves it off for grad_input and
grad_weight (gemm_config_* defaults, under both recipes: an accuracy choice, pytorch/ao#2377), and
Transformer Engine's linears likewise (module/base.py: _2X_ACC_FPROP False, _2X_ACC_DGRAD and
_2X_ACC_WGRAD True, passed as use_split_accumulator). A profile measures both ("fp8_fast", "fp8");
without one all three run at the device's float8 speed-up (DeviceSpec.fp8_matmul_speedup, whose
measurement found the split ones within 1% of the fast one)."""
CAST_ELEMENT_KERNELS = 6
"""abs, max, to(fp32), mul, clamp, to(fp8): element passes of one eager cast (5 from fp32)."""
CAST_SCALAR_KERNELS = 3
"""amax_to_scale on the amax: to(fp64), clamp, divide (then the scale's to(fp32): folded in)."""
FORWARD_CASTS = {"input": 1, "weight": 1}
BACKWARD_CASTS = {"grad_output": 2, "weight": 1, "input": 1}


@dataclass(frozen=True, kw_only=True)
class CastHandling:
    """How a framework runs float8 casts (see the module docstring)."""

    name: str
    element_passes: str
    """"eager": torchao's op-by-op sequence; "amax_then_cast": an amax reduction, then one fused
    scale-and-cast pass; "one_pass": the cast reads the source once (delayed scaling)."""
    layouts_per_cast: int = 1
    """float8 copies one cast writes (TE writes the row-major one and its transpose together)."""
    forward_casts: tuple[tuple[str, int], ...] = tuple(FORWARD_CASTS.items())
    backward_casts: tuple[tuple[str, int], ...] = tuple(BACKWARD_CASTS.items())
    weight_cast_once_per_step: bool = False
    """The float8 weight is cast on the step's first microbatch and kept (TE's is_first_microbatch)."""
    float8_all_gather: bool = True
    """Weights FSDP gathers are gathered in float8, cast on their shard (torchao's
    enable_fsdp_float8_all_gather under the tensorwise recipe); Megatron's distributed optimizer
    gathers its bf16 parameters (TE's fp8_param_gather off, NeMo's default)."""
    tp_input_gather_in_float8: bool = False
    """Sequence-parallel inputs of column-parallel float8 linears are cast on their shard and
    all-gathered in float8 (torchtitan's Float8ColwiseParallel / PrepareFloat8ModuleInput);
    autopar's runtime gathers them in bf16 (the plan's redistribution precedes the cast)."""
    norm_fused_input_cast: bool = False
    """A linear whose input is a normalization's output gets it in float8 from the norm kernel
    (TE's LayerNormLinear: the norm writes the float8 copies instead of its bf16 output), no cast."""
    saves_float8_inputs: bool = False
    """Backward reads the forward's float8 input (TE saves it, 1 byte per element); torchao saves
    the high-precision input and casts it again."""
    amax_reduced_per_region: bool = False
    """Delayed scaling: the amaxes a region's casts record are all-reduced together when the region
    ends, not one all-reduce per cast before it. TransformerEngine reduces at the exit of each
    outermost fp8_autocast (Megatron-Core: one per model chunk and microbatch, its forward) and once
    in that region's backward (FP8GlobalStateManager.reduce_and_update_fp8_tensors), a blocking MAX
    all-reduce over the amax reduction group: Megatron's tensor-, data- and context-parallel ranks
    of a pipeline stage (get_amax_reduction_group)."""
    norm_fused_amax: bool = False
    """A linear whose input is a normalization's output gets that input's amax from the norm
    kernel (TE's current scaling: the norm writes its bf16 output and the amax), so its cast is the
    cast pass alone (read h, write the layouts), not an amax pass and a cast pass."""
    amax_on_sequence_shards: bool = False
    """Current scaling under sequence parallelism as TE runs it: the amax of a column-parallel
    linear's input (cast on its sequence shard, then gathered in float8) and of a row-parallel
    linear's grad_output is all-reduced over tp before the cast (TE's amax_reduction_group), one
    each; torchao all-reduces the amax of every cast of an operand a DTensor shards."""
    shared_input_cast_once: bool = False
    """Linears that read one input cast it once, forward and backward (Megatron-Core's fused QKV
    and fc1 linears: one LayerNormLinear where autopar's graph has q, k, v or gate, up; torchtitan's
    compiled blocks: the identical casts of one tensor are one, `joint_graph_cse`)."""
    joint_graph_cse: bool = False
    """The casts are compiled with the forward and the backward as one joint graph (torch.compile:
    AOTAutograd's min-cut partitioner, which inductor uses, first eliminates the joint graph's
    common subexpressions, functorch's config `cse`): identical casts run once (`for_recipe`)."""
    weight_recast_pass_only: bool = False
    """The backward's weight cast reuses the scale the forward computed (saved for backward): a
    cast pass without the amax pass."""
    backward_layout_bytes: tuple[tuple[str, int], ...] = ()
    """Bytes per element of each operand's float8 copy laid out again for a backward matmul
    (torch._scaled_mm takes its first operand row-major, its second column-major; torchao's
    preprocess_addmm copies an operand in the other layout: 2, a read and a write; 1 where
    inductor writes the second layout from the cast's own kernel)."""

    rowwise_rescale_bytes: int = 0
    """torchao's rowwise backward matmuls (grad_input, grad_weight; use_fast_accum off) run cuBLAS's
    tensorwise kernel with unit scales and multiply the bf16 output by the outer product of the two
    scale vectors afterwards (float8_ops.addmm_float8_unwrapped, since pytorch/ao#1377, 2024-12:
    PyTorch's rowwise CUTLASS kernel is slow without fast accumulation): bytes per output element of
    that pass where it runs apart. Eager it materializes the fp32 product (write 4) and multiplies in
    place (read 2 and 4, write 2): 12 in 2 kernels; compiled one fused pass (read 2, write 2): 4 in 1.
    0: the framework is not torchao (TE scales in its GEMM's epilogue)."""
    experts_as_linears: bool = False
    """The framework runs each expert's matmuls as a float8 linear of its own and casts them as its
    linears (TransformerEngine under Megatron-Core's SequentialMLP or TEGroupedMLP: each expert's
    rows cast as a linear's input, its grad_output likewise, its weight once per step; no padding
    or re-layout copies); else torchao's rowwise grouped-GEMM casts and autopar's copies around
    them (autopar/solver/fp8_experts.py)."""
    rescale_fused_into_consumers: bool = False
    """The rescale of a grad_input runs inside its consumer's kernel (torchtitan compiles each block
    whole: inductor folds the pointwise multiply into the backward of the elementwise op or norm that
    produced the linear's input); apart where that producer ran on tensor cores (attention, a
    matmul: an extern kernel takes the rescaled tensor). A grad_weight leaves the compiled graph:
    its rescale always runs apart."""

    def for_recipe(self, recipe: str) -> CastHandling:
        """The handling as it runs `recipe`'s casts. Compiled as one joint graph (`joint_graph_cse`),
        torchao's tensorwise linear (matmul_with_hp_or_float8_args) casts the same grad_output twice
        in backward (for grad_input and for grad_weight) and the same weight in forward and backward:
        each pair is one, the backward's weight cast a cast pass with the forward's scale. The
        backward's input cast (of its 2-D view) and every rowwise cast (each along its own axis)
        stay: rowwise runs all six. Only rowwise rescales its backward matmuls' outputs apart
        (`rowwise_rescale_bytes`)."""
        if recipe == "rowwise":
            return self
        handling = replace(self, rowwise_rescale_bytes=0)
        if not self.joint_graph_cse:
            return handling
        return replace(handling, backward_casts=(("grad_output", 1), ("weight", 1), ("input", 1)),
                       weight_recast_pass_only=True, joint_graph_cse=False, backward_layout_bytes=(("grad_output", 1),))

    def rescale_pass_s(self, output_elements: float, *, bandwidth_bytes_per_s: float,
                       kernel_overhead_s: float) -> float:
        """One rowwise backward matmul's rescale pass over its `output_elements` outputs, where it
        runs apart (`rowwise_rescale_bytes`; 0 where the handling scales inside the GEMM)."""
        if not self.rowwise_rescale_bytes:
            return 0.0
        kernels = 2 if self.element_passes == "eager" else 1
        return output_elements * self.rowwise_rescale_bytes / bandwidth_bytes_per_s + kernels * kernel_overhead_s

    def bytes_per_element(self, source_bytes: int) -> float:
        if self.element_passes == "eager":
            return cast_bytes_per_element(source_bytes)
        reads = 2 if self.element_passes == "amax_then_cast" else 1
        return reads * source_bytes + self.layouts_per_cast * FP8_BYTES

    def kernels(self, source_bytes: int) -> int:
        if self.element_passes == "eager":
            return cast_kernels(source_bytes)
        return 2 if self.element_passes == "amax_then_cast" else 1


HANDLINGS = {
    "eager": CastHandling(name="eager", element_passes="eager", rowwise_rescale_bytes=12,
                          backward_layout_bytes=(("input", 2), ("weight", 2), ("grad_output", 2))),
    "compiled": CastHandling(name="compiled", element_passes="amax_then_cast", joint_graph_cse=True,
                             rowwise_rescale_bytes=4),
    "torchtitan": CastHandling(name="torchtitan", element_passes="amax_then_cast", tp_input_gather_in_float8=True,
                               joint_graph_cse=True, shared_input_cast_once=True, rowwise_rescale_bytes=4,
                               rescale_fused_into_consumers=True),
    "torchtitan-2024": CastHandling(name="torchtitan-2024", element_passes="amax_then_cast",
                                    rowwise_rescale_bytes=4, rescale_fused_into_consumers=True,
                                    tp_input_gather_in_float8=True, backward_casts=(("grad_output", 1),),
                                    saves_float8_inputs=True, shared_input_cast_once=True,
                                    backward_layout_bytes=(("input", 2), ("weight", 2), ("grad_output", 1))),
    "te": CastHandling(name="te", element_passes="one_pass", layouts_per_cast=2, tp_input_gather_in_float8=True,
                       forward_casts=(("input", 1), ("weight", 1)), backward_casts=(("grad_output", 1),),
                       weight_cast_once_per_step=True, float8_all_gather=False, norm_fused_input_cast=True,
                       saves_float8_inputs=True, amax_reduced_per_region=True, shared_input_cast_once=True,
                       experts_as_linears=True),
    "te-current": CastHandling(name="te-current", element_passes="amax_then_cast", layouts_per_cast=2,
                               forward_casts=(("input", 1), ("weight", 1)), backward_casts=(("grad_output", 1),),
                               weight_cast_once_per_step=True, float8_all_gather=False, norm_fused_amax=True,
                               tp_input_gather_in_float8=True, saves_float8_inputs=True,
                               amax_on_sequence_shards=True, shared_input_cast_once=True, experts_as_linears=True),
}
"""The cast handlings a price can be asked for: autopar's runtime runs "eager" (torchao without
torch.compile) or "compiled" (RUNTIME_HANDLINGS); published runs are priced with the handling
their framework ran."""

RUNTIME_HANDLINGS = ("compiled", "eager")
"""The handlings autopar's own runtime runs (Plan.fp8_casts)."""


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


def cast_counts(handling: CastHandling | None) -> dict[str, int]:
    """Casts of each operand ("input", "weight", "grad_output") per linear and microbatch, forward
    and backward (a weight cast once per step counted here too)."""
    handling = handling or HANDLINGS["eager"]
    counts: dict[str, int] = {}
    for operand, count in handling.forward_casts + handling.backward_casts:
        counts[operand] = counts.get(operand, 0) + count
    return counts


def cast_elements(linear: Fp8LinearElements, *, weight_precast: bool, handling: CastHandling | None = None) -> float:
    """Elements cast per microbatch (forward and backward) from the compute dtype; a weight
    gathered in float8, or cast once per step (handling.weight_cast_once_per_step), is not cast
    here."""
    skip_weight = weight_precast or (handling is not None and handling.weight_cast_once_per_step)
    return sum(count * getattr(linear, operand) for operand, count in cast_counts(handling).items()
               if not (operand == "weight" and skip_weight))


def num_casts(*, weight_precast: bool, handling: CastHandling | None = None) -> int:
    skip_weight = weight_precast or (handling is not None and handling.weight_cast_once_per_step)
    return sum(count for operand, count in cast_counts(handling).items() if not (operand == "weight" and skip_weight))


def layout_copy_time_s(linear: Fp8LinearElements, handling: CastHandling, *, input_shared: bool,
                       bandwidth_bytes_per_s: float, kernel_overhead_s: float) -> float:
    """One linear's backward float8 layout copies per microbatch (CastHandling.backward_layout_bytes);
    an input another linear already cast is laid out once, by that linear."""
    seconds = 0.0
    for operand, size in handling.backward_layout_bytes:
        if operand == "input" and input_shared:
            continue
        seconds += getattr(linear, operand) * size / bandwidth_bytes_per_s + (kernel_overhead_s if size > 1 else 0.0)
    return seconds


def amax_counts(handling: CastHandling | None) -> dict[str, int]:
    """Amax reductions of each operand per linear and microbatch: one per cast, except a weight
    cast that reuses the forward's scale (CastHandling.weight_recast_pass_only)."""
    counts = cast_counts(handling)
    if handling is not None and handling.weight_recast_pass_only and counts.get("weight"):
        counts["weight"] -= 1
    return counts


def weight_casts_per_step(handling: CastHandling | None = None) -> int:
    """Casts of each weight per step where the handling casts it once per step (0 otherwise)."""
    if handling is None or not handling.weight_cast_once_per_step:
        return 0
    return cast_counts(handling).get("weight", 0)


def cast_time_s(elements: float, casts: int, *, source_bytes: int, bandwidth_bytes_per_s: float,
                kernel_overhead_s: float, handling: CastHandling | None = None) -> float:
    """Casts of `elements` elements in `casts` casts (eager torchao unless `handling` says)."""
    handling = handling or HANDLINGS["eager"]
    return (elements * handling.bytes_per_element(source_bytes) / bandwidth_bytes_per_s
            + casts * handling.kernels(source_bytes) * kernel_overhead_s)


def all_gather_bytes_saved(weight_numel: float, param_bytes: int) -> float:
    """Bytes per gathered element FSDP2 no longer moves when it gathers a weight in float8
    instead of in the compute dtype (`param_bytes`), times the weight's elements."""
    return weight_numel * (param_bytes - FP8_BYTES)


def held_weight_bytes(weight_elements: float, handling: CastHandling | None = None) -> float:
    """Float8 weight copies kept through the step (TE casts once per step and keeps them): one
    byte per element per layout; 0 where the handling casts per use."""
    if handling is None or not handling.weight_cast_once_per_step:
        return 0.0
    return weight_elements * handling.layouts_per_cast * FP8_BYTES


def transient_bytes(linear: Fp8LinearElements) -> float:
    """The float8 copies alive around one linear's matmuls: the forward's input and weight copies,
    or the backward's two grad_output copies with the weight and input copies (the larger)."""
    forward = linear.input + linear.weight
    backward = 2 * linear.grad_output + linear.weight + linear.input
    return max(forward, backward) * FP8_BYTES

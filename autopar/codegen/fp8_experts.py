"""Float8 expert grouped matmuls of precision "fp8": torchao's rowwise FP8 grouped GEMM.

**What runs.** The expert weights of Plan.fp8_experts (solver/fp8.py's rule: 3-D weights of
grouped matmuls, both matmul dims multiples of 16) have their grouped matmuls
`out[S, N] = tokens[S, K] @ weight[e(row), K, N]` run as torchtitan's Float8GroupedExperts runs
them (torchtitan/components/quantization/float8.py): torchao's
`_quantize_then_scaled_grouped_mm(A, B_t, config=Float8TrainingOpConfig(), offs)`, whose
autograd.Function (`_Float8GroupedMM`, torchao/prototype/moe_training/fp8_grouped_mm.py) casts
each operand to float8 e4m3 with per-row scales rounded to powers of two and runs
`torch._scaled_grouped_mm` (compute capability 9.0+):

    forward   tokens rowwise (a scale per row, over K), weight per expert and column (over K)
    backward  grad_output rowwise (over N) and the weight per expert and row (over N) for the
              token gradient; for the weight gradient both grad_output and tokens per expert's
              rows and column (each expert's group of rows scaled on its own)

torchao's kernels need every expert's rows a multiple of 16 (torchtitan's TorchAOTokenDispatcher
pads them in its permutation) and the weight column-major per expert (torchtitan stores experts
[E, N, K] and passes a transpose): the moe family stores [E, K, N], so here each call pads the
rows (zero rows, dropped after) and copies the weight column-major. torchao's Function would save
that copy for the backward (a weight-sized tensor per op and microbatch in flight); under
saved_tensors_hooks it saves the weight instead (as the bf16 grouped matmul does) and the backward
copies it again. Both are priced (solver/fp8_experts.py: fp8.copy.experts).

**Emulated (CPUs, and the gloo tests).** torchao's FP8 grouped GEMM is CUDA only (Triton kernels
and `torch._scaled_grouped_mm`; its padding helper says "TODO: support emulated mode"), so on
other devices `EmulatedFloat8GroupedMM` runs the same recipe as the smallest honest emulation:
each operand quantised to float8 e4m3 with the same scales, computed by torchao's own helpers
(`tensor_to_scale` with axiswise scaling and power-of-two scales, `to_fp8_saturated`), then
dequantised and multiplied in float32, the result (and the gradients) in torchao's out_dtype,
bfloat16. It differs from the kernel only in accumulation order (the kernel uses fast
accumulation).

**Composition.** Expert parallelism: codegen/experts.py's ExpertRunner calls `grouped_mm` on the
rows dispatched to this rank's experts (the local grouped matmul after the all-to-all), so the
per-expert groups of the weight gradient's scales are the group's rows of every ep rank, as one
process's. Tensor parallelism without ep: the interpreter's local rule (codegen/local_ops.py) runs
it on each tp rank's shards. FSDP2 (ZeRO-1/2/3): the weights arrive gathered (bf16 under its
mixed-precision policy), as torchtitan's Float8GroupedExperts gets them: rowwise scales are per row,
so nothing is gathered in float8. Pipelining and recomputation: the same call in each stage's segments.

**Where it stays bf16, and says so.** A call whose local dims (K, N after tp sharding) are not
multiples of 16, or on a CUDA device below compute capability 9.0 (no `_scaled_grouped_mm`), runs
the op's own bf16 grouped matmul; the first such call warns, and `bf16_calls` counts them.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor

from autopar.models.grouped_mm import row_ranges
from autopar.strategies.grouped_mm import GROUPED_MM_TARGETS

FP8_GROUP_ROWS = 16
"""torchao's FP8 grouped GEMM needs each expert's rows a multiple of 16 (torchtitan's PAD_MULTIPLE)."""
FP8_DIM_MULTIPLE = 16
"""K and N of the weight: multiples of 16 (the float8 tensor cores' alignment)."""
SCALED_GROUPED_MM_CAPABILITY = (9, 0)
"""`torch._scaled_grouped_mm` runs on Hopper and later."""


def _dequantized(value: torch.Tensor, dim: int) -> torch.Tensor:
    """`value` cast to float8 e4m3 with one power-of-two scale per slice along `dim` (torchao's
    axiswise scaling) and back, in float32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    dtype = torch.float8_e4m3fn
    scale = tensor_to_scale(value, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
    return to_fp8_saturated(value.to(torch.float32) * scale, dtype).to(torch.float32) / scale


class EmulatedFloat8GroupedMM(torch.autograd.Function):
    """torchao's `_Float8GroupedMM` recipe, emulated (module docstring): tokens [S, K], weight
    [E, K, N], offs [E] (int, cumulative end rows) -> [S, N] in `out_dtype`; rows past offs[-1]
    are zero (and get zero gradient)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        ctx.save_for_backward(tokens, weight, offs)
        ctx.out_dtype = out_dtype
        rows = _dequantized(tokens, -1)  # a scale per row, over K
        experts = _dequantized(weight, -2)  # per expert and column, over K
        output = rows.new_zeros(tokens.shape[0], weight.shape[2])
        for expert, start, end in row_ranges(offs):
            output[start:end] = rows[start:end] @ experts[expert]
        return output.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        tokens, weight, offs = ctx.saved_tensors
        grad_rows = _dequantized(grad_output, -1)  # a scale per row, over N
        experts = _dequantized(weight, -1)  # per expert and row, over N
        grad_tokens = grad_rows.new_zeros(tokens.shape)
        grad_weight = grad_rows.new_zeros(weight.shape)
        for expert, start, end in row_ranges(offs):
            grad_tokens[start:end] = grad_rows[start:end] @ experts[expert].t()
            # the weight gradient: each expert's rows scaled per column on their own
            group_tokens = _dequantized(tokens[start:end], 0)
            group_grads = _dequantized(grad_output[start:end], 0)
            grad_weight[expert] = group_tokens.t() @ group_grads
        return grad_tokens.to(ctx.out_dtype), grad_weight.to(ctx.out_dtype), None, None


class _Spread(torch.autograd.Function):
    """rows [R, C] -> [padded_rows, C] with row i at positions[i] and the padding rows zero; its
    backward gathers them back (one pass each way, no zero fill of the whole buffer)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, padded_rows: int):
        ctx.save_for_backward(positions)
        spread = rows.new_empty(padded_rows, rows.shape[1]).index_copy_(0, positions, rows)
        return spread.index_fill_(0, padding, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return grad.index_select(0, positions), None, None, None


class _Gather(torch.autograd.Function):
    """The inverse of _Spread: [padded_rows, C] -> the rows at `positions`."""

    @staticmethod
    def forward(ctx, spread: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor):
        ctx.save_for_backward(positions, padding)
        ctx.padded_rows = spread.shape[0]
        return spread.index_select(0, positions)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        positions, padding = ctx.saved_tensors
        return _Spread.apply(grad, positions, padding, ctx.padded_rows), None, None


def _padding(offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each expert's group of rows padded to FP8_GROUP_ROWS: its offsets, the padded position of
    every row before offs[-1], the positions of the padding rows)."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    padded_counts = (counts + FP8_GROUP_ROWS - 1) // FP8_GROUP_ROWS * FP8_GROUP_ROWS
    padded_offs = padded_counts.cumsum(0)
    shift = (padded_offs - padded_counts) - (offs.long() - counts)  # where a group moves
    positions = torch.arange(int(offs[-1]), device=offs.device) + torch.repeat_interleave(shift, counts)
    padding = torch.ones(int(padded_offs[-1]), dtype=torch.bool, device=offs.device)
    padding[positions] = False
    return padded_offs.to(torch.int32), positions, padding.nonzero().flatten()


def torchao_grouped_mm(tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchao's FP8 rowwise grouped GEMM on CUDA, as torchtitan calls it (module docstring)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    padded_offs, positions, padding = _padding(offs)
    used = positions.shape[0]
    padded = _Spread.apply(tokens[:used].to(torch.bfloat16), positions, padding, int(padded_offs[-1]))
    weight = weight.to(torch.bfloat16)
    column_major = _column_major(weight)
    with torch.autograd.graph.saved_tensors_hooks(*_copy_not_saved(column_major, weight)):
        output = _quantize_then_scaled_grouped_mm(padded, column_major, config=Float8TrainingOpConfig(),
                                                  offs=padded_offs)
    rows = _Gather.apply(output, positions, padding)
    if rows.shape[0] == tokens.shape[0]:
        return rows
    return torch.cat([rows, rows.new_zeros(tokens.shape[0] - rows.shape[0], rows.shape[1])])


def _column_major(weight: torch.Tensor) -> torch.Tensor:
    """[E, K, N] with strides (K N, 1, K): each expert's matrix column-major, as torchao's B_t."""
    return weight.transpose(-2, -1).contiguous().transpose(-2, -1)


class _WeightRef:
    """What is saved for backward in place of a weight's column-major copy: the weight itself."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


class _Outer:
    """A tensor packed by the hooks that were active around ours (recomputation's checkpoint)."""

    def __init__(self, packed, unpack) -> None:
        self.packed, self.unpack = packed, unpack


def _copy_not_saved(copy: torch.Tensor, weight: torch.Tensor):
    """saved_tensors_hooks under which torchao's Function saves `weight` (which the bf16 grouped
    matmul saves too, and FSDP2 gathers again for the backward) instead of its column-major
    `copy`; the backward copies it again. Other tensors go to the hooks active around these
    (torch.utils.checkpoint's, in a recomputed region), else are saved as they are."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # torch keeps only the innermost pair

    def pack(value: torch.Tensor):
        if value.data_ptr() == copy.data_ptr() and value.shape == copy.shape and value.stride() == copy.stride():
            return _WeightRef(weight)
        return _Outer(outer[0](value), outer[1]) if outer is not None else value

    def unpack(value):
        if isinstance(value, _WeightRef):
            return _column_major(value.weight)
        return value.unpack(value.packed) if isinstance(value, _Outer) else value

    return pack, unpack


class Float8GroupedMM:
    """Runs the plan's float8 expert grouped matmuls of one rank's program."""

    def __init__(self, weights: tuple[str, ...], device: torch.device) -> None:
        self.weights = frozenset(weights)
        """FQNs of the expert weights whose grouped matmuls run in float8 (Plan.fp8_experts)."""
        self.emulated = device.type != "cuda"
        """torchao's kernels are CUDA only: elsewhere EmulatedFloat8GroupedMM."""
        self.blocker = ""
        """Why no grouped matmul runs in float8 on this device ("": they can)."""
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < SCALED_GROUPED_MM_CAPABILITY:
            major, minor = torch.cuda.get_device_capability(device)
            self.blocker = (f"torch._scaled_grouped_mm needs compute capability 9.0+, and "
                            f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
        self.nodes: frozenset[str] = frozenset()
        """Names of the grouped-matmul nodes (of the codegen graph) that run in float8."""
        self.num_calls = 0
        """Grouped matmuls run in float8 so far (forward passes, recomputations included)."""
        self.bf16_calls: dict[str, str] = {}
        """Node -> why its grouped matmul ran in bf16 (the plan listed it in float8)."""

    def install(self, interpreter, param_of: dict[str, str], fx_nodes: dict[str, torch.fx.Node]) -> None:
        """Route the chosen grouped matmuls (those reading a weight of the plan's list) through
        `matmul` where the interpreter runs them (no ep; on tp shards through the local rule); under
        ep the expert runner calls `matmul` itself (ProgramBuilder.use_expert_parallelism)."""
        self.nodes = frozenset(name for name, node in fx_nodes.items()
                               if str(node.target) in GROUPED_MM_TARGETS and len(node.args) > 1
                               and param_of.get(_weight_source(node.args[1])) in self.weights)
        from autopar.codegen.local_ops import has_local_rule, run_sharded

        for target in {node.target for name, node in fx_nodes.items() if name in self.nodes}:
            previous = interpreter.overrides.get(target)

            def run(node, args, kwargs, previous=previous):
                if node.name not in self.nodes:
                    return previous(node, args, kwargs) if previous is not None else node.target(*args, **kwargs)
                matmul = self.matmul(node)
                if interpreter.distributed and any(isinstance(value, DTensor) for value in args):
                    output = interpreter.placements.get(node.name, (None, []))[0]
                    assert has_local_rule(node.target), node.target
                    return run_sharded(matmul, args, kwargs, interpreter.mesh, output or "R")
                return matmul(*args, **kwargs)

            interpreter.overrides[target] = run

    def matmul(self, node: torch.fx.Node):
        """`node.target`'s replacement for a chosen node, called as the op is: (tokens, weight,
        offs) positionally, or aten._grouped_mm's (tokens, weight, offs=offs)."""
        def matmul(*args, **kwargs):
            tokens, weight, *rest = args
            offs = kwargs["offs"] if "offs" in kwargs else rest[0] if rest else None
            extra = rest[1:] if "offs" not in kwargs else rest
            others = {name: value for name, value in kwargs.items() if name != "offs" and value is not None}
            reason = self.blocker or _shape_blocker(weight) or (
                "arguments torchao's grouped GEMM does not take" if extra or others or offs is None else "")
            if reason:
                self._in_bf16(node.name, reason)
                return node.target(*args, **kwargs)
            return self.grouped_mm(tokens, weight, offs)

        return matmul

    def grouped_mm(self, tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The float8 grouped matmul on local tensors: torchao's on CUDA, else emulated."""
        self.num_calls += 1
        if self.emulated:
            return EmulatedFloat8GroupedMM.apply(tokens, weight, offs, torch.bfloat16)
        return torchao_grouped_mm(tokens, weight, offs)

    def _in_bf16(self, node: str, reason: str) -> None:
        if node not in self.bf16_calls:
            warnings.warn(f"autopar fp8: the expert grouped matmul {node} runs in bf16, not float8 ({reason})",
                          RuntimeWarning, stacklevel=4)
        self.bf16_calls[node] = reason


def _weight_source(value) -> str:
    """The placeholder a grouped matmul's weight comes from (through a transpose view)."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args:
        value = value.args[0]
    return getattr(value, "name", "")


def _shape_blocker(weight: torch.Tensor) -> str:
    if weight.dim() != 3:
        return f"a {weight.dim()}-D weight (torchao's grouped GEMM takes [experts, K, N])"
    _, k, n = weight.shape
    if k % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE:
        return f"its local weight is [{weight.shape[0]}, {k}, {n}]: K and N must be multiples of {FP8_DIM_MULTIPLE}"
    return ""

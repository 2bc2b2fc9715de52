"""`autopar::grouped_mm`: expert matmuls of rows sorted by expert, as one op with its own backward.

    out[S, N] = input[S, K] @ weight[e(row), K, N]   where rows [offs[e-1], offs[e]) belong to expert e

On CUDA in bfloat16 it calls `torch._grouped_mm` (one kernel for all experts, as torchtitan);
elsewhere a loop of `torch.mm` over the experts' row ranges. `torch._grouped_mm` on CPU fails in
the backward for small shapes (torch 2.13), and its CPU path is float-only anyway, so the op
is a `torch.library.custom_op` with a fake (shape) implementation and a registered backward
that is a custom op too (`autopar::grouped_mm_backward`): autograd and `torch.export` see two
opaque ops instead of a data-dependent loop, as in transformers' `grouped_mm_fallback`.

Rows past offs[-1] are zero in the loop's output and input gradient and undefined in the
kernel's; the moe layer has none (offs[-1] is every row), and codegen's expert parallelism
passes only the rows before offs[-1] (codegen/experts.py). The kernel path is not exercised
on this project's CPU test machines. The graph names the op `grouped_mm.default` or
`autopar.grouped_mm.default` (capture/export.py's `_target_name`); the planner's expert
parallelism (solver/experts.py) and codegen recognise both.
"""

from __future__ import annotations

import torch

__all__ = ["expert_bias", "grouped_mm"]


def _kernel_ok(tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
    """torch._grouped_mm's contract: CUDA, bfloat16, int32 offsets."""
    return (tokens.is_cuda and tokens.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and offs.dtype == torch.int32 and hasattr(torch, "_grouped_mm"))


def row_ranges(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows (one device-to-host copy)."""
    ranges, start = [], 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            ranges.append((expert, start, end))
        start = max(start, end)
    return ranges


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """tokens [S, K], weight [E, K, N], offs [E] (int, cumulative end rows) -> [S, N]."""
    if _kernel_ok(tokens, weight, offs):
        return torch._grouped_mm(tokens, weight, offs=offs)
    output = tokens.new_zeros(tokens.shape[0], weight.shape[2])
    for expert, start, end in row_ranges(offs):
        output[start:end] = tokens[start:end] @ weight[expert]
    return output


@grouped_mm.register_fake
def _grouped_mm_fake(tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(tokens.dim() == 2 and weight.dim() == 3 and offs.dim() == 1,
                 lambda: "grouped_mm takes tokens [S, K], weight [E, K, N] and offs [E]")
    torch._check(tokens.shape[1] == weight.shape[1], lambda: "grouped_mm: tokens and weight differ in K")
    torch._check(offs.shape[0] == weight.shape[0], lambda: "grouped_mm: one offset per expert")
    return tokens.new_empty(tokens.shape[0], weight.shape[2])


@torch.library.custom_op("autopar::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(tokens: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of tokens, gradient of weight) of `grouped_mm`."""
    if _kernel_ok(tokens, weight, offs) and grad_output.dtype == torch.bfloat16:
        grad_tokens = torch._grouped_mm(grad_output, weight.transpose(-2, -1), offs=offs)
        grad_weight = torch._grouped_mm(tokens.t(), grad_output, offs=offs)
        return grad_tokens, grad_weight
    grad_tokens, grad_weight = torch.zeros_like(tokens), torch.zeros_like(weight)
    for expert, start, end in row_ranges(offs):
        grad_tokens[start:end] = grad_output[start:end] @ weight[expert].t()
        grad_weight[expert] = tokens[start:end].t() @ grad_output[start:end]
    return grad_tokens, grad_weight


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(tokens, weight, offs, grad_output):
    return torch.empty_like(tokens), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    tokens, weight, offs = inputs
    ctx.save_for_backward(tokens, weight, offs)


def _backward(ctx, grad_output):
    tokens, weight, offs = ctx.saved_tensors
    grad_tokens, grad_weight = torch.ops.autopar.grouped_mm_backward(tokens, weight, offs, grad_output)
    return grad_tokens, grad_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def _row_experts(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each of `rows` rows sorted by expert (offs: cumulative rows per expert); rows
    past offs[-1] get len(offs). One binary search per row on the device: no size depends on the
    counts, so no device-to-host copy waits for the GPU (a repeat_interleave by counts would)."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def _padded(bias: torch.Tensor) -> torch.Tensor:
    """bias [E, N] with a zero row E, the bias of rows past offs[-1]."""
    return torch.cat((bias, bias.new_zeros(1, bias.shape[1])))


@torch.library.custom_op("autopar::expert_bias", mutates_args=())
def expert_bias(rows: torch.Tensor, bias: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [S, N] sorted by expert, bias [E, N], offs [E] -> rows + bias[e(row)] (rows past
    offs[-1] unchanged): the per-expert bias torch._grouped_mm does not take, one gather and one
    add, a row-local op that runs on dispatched rows with the rank's experts' block (solver/experts.py)."""
    experts = _row_experts(offs, rows.shape[0])
    return rows + _padded(bias).index_select(0, experts).to(rows.dtype)


@expert_bias.register_fake
def _expert_bias_fake(rows: torch.Tensor, bias: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(rows.dim() == 2 and bias.dim() == 2 and offs.dim() == 1,
                 lambda: "expert_bias takes rows [S, N], bias [E, N] and offs [E]")
    torch._check(rows.shape[1] == bias.shape[1] and offs.shape[0] == bias.shape[0],
                 lambda: "expert_bias: bias [E, N] must match rows [S, N] and offs [E]")
    return torch.empty_like(rows)


@torch.library.custom_op("autopar::expert_bias_backward", mutates_args=())
def expert_bias_backward(grad_output: torch.Tensor, bias: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The bias's gradient of `expert_bias`: each expert's rows of grad_output summed."""
    experts = _row_experts(offs, grad_output.shape[0])
    grad_bias = torch.zeros((bias.shape[0] + 1, bias.shape[1]), dtype=torch.float32, device=bias.device)
    grad_bias.index_add_(0, experts, grad_output.float())
    return grad_bias[:-1].to(bias.dtype)


@expert_bias_backward.register_fake
def _expert_bias_backward_fake(grad_output, bias, offs):
    return torch.empty_like(bias)


def _bias_setup_context(ctx, inputs, output) -> None:
    rows, bias, offs = inputs
    ctx.save_for_backward(bias, offs)


def _bias_backward(ctx, grad_output):
    bias, offs = ctx.saved_tensors
    return grad_output, torch.ops.autopar.expert_bias_backward(grad_output, bias, offs), None


expert_bias.register_autograd(_bias_backward, setup_context=_bias_setup_context)

"""Weight gradients accumulated into the fp32 `.grad` inside the weight-gradient GEMM.

A bf16 plan computes with a step's bf16 copies of fp32 weights (program.WeightCasts). Through the
copy (main_grad.AccumulatingCast) each microbatch's linear backward runs the weight-gradient GEMM
with a bf16 output, then one kernel adds that into the fp32 `.grad` (read 2 + 4 bytes, write 4
per element; the first microbatch's is a cast: read 2, write 4). Megatron-LM's
gradient_accumulation_fusion instead runs the GEMM with fp32 C and D pointing at the fp32
main_grad and beta = 1: the add happens in the GEMM's epilogue, and no pass over the gradient
follows. Here a linear reading a step copy (`aten.linear` in the captured graph) does the same:
its forward is the same op on the same tensors; its backward computes the input's and the bias's
gradients as autograd would, and accumulates the weight's straight into `weight.grad`:

- "cuda": `torch.addmm(grad32, dY^T, X, out_dtype=float32, out=grad32)` (aten.addmm.dtype_out:
  cuBLAS with fp32 C/D, beta = 1); the first microbatch writes with `torch.mm(..., out_dtype=float32)`;
- "emulate": the same sums on any device as an fp32 GEMM of the upcast bf16 operands (bf16
  products are exact in fp32, so it is the fused kernel's arithmetic up to summation order), for
  tests on CPU, where torch has no `out_dtype` matmul;
- "off": no fusion (the copy's cast-and-add above), the default where the CUDA kernel is absent.

`AUTOPAR_FUSED_WGRAD` (off | emulate | cuda) overrides the default ("cuda" on CUDA devices where
the op accepts an fp32 accumulator, else "off").

Autograd still runs the weight's AccumulateGrad node (it receives no gradient), so its
post-accumulate-grad hooks fire once per backward as before (grad_overlap.py counts them).

Under tensor parallelism the weight, its gradient and the activations are DTensors; the GEMM runs
on local tensors only where the local product is exactly this rank's shard of the weight's
gradient (strategies/placement.local_weight_grad: replicated, column- or row-parallel). The
planner prices fusion for the same weights (solver/evaluate.py). A gradient that arrives
otherwise placed is computed as a DTensor, redistributed to the weight's placement and added.
Zero-bubble schedules (their weight pass asks autograd for the weights' gradients) never reach
this code.

Under FSDP2 (ZeRO-1/2, codegen/data_parallel.py) there are no step copies: the linears read the
gathered bf16 parameter itself (MixedPrecisionPolicy). Without gradient sync FSDP2 casts that
parameter's bf16 `.grad` into its fp32 `FSDPParam.unsharded_accumulated_grad` after the first
microbatch and adds it there after each later one (to_accumulated_grad_if_needed,
accumulate_unsharded_grad_if_needed in torch/distributed/fsdp/_fully_shard/_fsdp_param.py), and
reduce-scatters that buffer after the last: the same cast-and-add pass per microbatch. Where FSDP2
keeps that buffer (solver/step_tail.fsdp_fuses_wgrad: ZeRO-1, ZeRO-2 under pipelining, more than
one microbatch) the GEMM accumulates into it instead (FsdpGradients), creating it on the first
microbatch, and autograd gets no weight gradient: FSDP2's post_backward finds no bf16 `.grad` to
cast or add, and reduce-scatters the buffer after the last microbatch as before. A backward that
would reduce-scatter with no buffer yet (a backward of the user's own after gradient sync) hands
autograd the bf16 gradient, as without fusion. The FSDPParam is found through FSDP2's private
state (`_get_fsdp_state()._fsdp_param_group.fsdp_params`, `_unsharded_param`); where a torch
build lacks these names the linears run unfused (counted as "fallback").
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from autopar.codegen.main_grad import accumulate_into_grad
from autopar.codegen.placements import to_plan_placement
from autopar.errors import ConfigError
from autopar.strategies.placement import local_weight_grad

KERNELS = ("off", "emulate", "cuda")
LINEAR = torch.ops.aten.linear.default
_ENV = "AUTOPAR_FUSED_WGRAD"
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def chosen_kernel(device: torch.device) -> str:
    """The kernel a rank on `device` uses: `AUTOPAR_FUSED_WGRAD` if set, else "cuda" where the
    CUDA op accumulates into fp32 (cuda_kernel_works), else "off"."""
    forced = forced_kernel(_ENV, KERNELS, "a fused weight-gradient kernel")
    if forced:
        return forced
    return "cuda" if device.type == "cuda" and cuda_kernel_works(device) else "off"


def forced_kernel(variable: str, kernels: tuple[str, ...], what: str) -> str | None:
    """The kernel the environment variable names (one of `kernels`), None where it is unset;
    another value is a ConfigError naming the choices."""
    forced = os.environ.get(variable, "").strip().lower()
    if forced and forced not in kernels:
        raise ConfigError(f"{variable}={forced!r} is not {what}: set it to one of {', '.join(kernels)}, or unset it "
                          "for the default")
    return forced or None


def cuda_kernel_works(device: torch.device) -> bool:
    """Whether `addmm(fp32 C, bf16, bf16, out_dtype=float32, out=C)` runs on `device` (older torch
    builds require C in the operands' dtype)."""
    try:
        accumulator = torch.zeros(2, 2, device=device)
        operand = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
        torch.addmm(accumulator, operand, operand, out_dtype=torch.float32, out=accumulator)
        return bool(accumulator[0, 0].item() == 2.0)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class FusedWgrad:
    """Runs a rank's linears on step copies with the weight gradient fused into `.grad`."""

    def __init__(self, weight_casts, kernel: str, stats: Counter | None = None) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown fused weight-gradient kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        self.weight_casts = weight_casts
        self.kernel = kernel
        self.stats = Counter() if stats is None else stats
        """"fused" and "fallback" counts (RunStats.fused_wgrad)."""
        self.fsdp: FsdpGradients | None = None
        """FSDP2's fp32 unsharded gradients, where the plan fuses under FSDP2 (use_fsdp)."""

    def use_fsdp(self, modules) -> None:
        """Accumulate the gathered parameters' gradients of these fully_shard modules into FSDP2's
        fp32 unsharded gradients (FsdpGradients)."""
        self.fsdp = FsdpGradients(modules, self.stats)

    def master_of(self, value) -> torch.Tensor | None:
        """The weight that accumulates `value`'s gradient here: the fp32 weight whose step copy
        `value` is, or under FSDP2 the gathered parameter `value` itself; else None."""
        weight = self.weight_casts.master_of(value)
        if weight is None and self.fsdp is not None and self.weight_casts.in_step:
            return value if self.fsdp.param_of(value) is not None else None
        return weight

    def master(self, target, args: tuple, output_placement: str | None) -> torch.Tensor | None:
        """The weight that accumulates `args[1]`'s gradient (master_of), where this linear can fuse;
        else None."""
        if self.kernel == "off" or target is not LINEAR or len(args) < 2:
            return None
        inputs, copy = args[0], args[1]
        weight = self.master_of(copy)
        if weight is None or copy.dtype not in _FUSED_DTYPES or inputs.dtype != copy.dtype:
            return None
        if isinstance(copy, DTensor) != isinstance(inputs, DTensor):
            return None
        if isinstance(copy, DTensor):
            if copy.device_mesh.ndim != 1 or output_placement is None:
                return None
            if not local_weight_grad(to_plan_placement(inputs.placements[0]), to_plan_placement(copy.placements[0]),
                                     output_placement, inputs.ndim):
                return None
        return weight

    def linear(self, weight: torch.Tensor, inputs: torch.Tensor, copy: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return FusedLinear.apply(inputs, weight, copy.detach(), bias, self)

    def accumulate(self, weight: torch.Tensor, grad: torch.Tensor, inputs: torch.Tensor) -> bool:
        """`weight.grad += grad^T @ inputs` (batch dims flattened), accumulated in fp32; under FSDP2
        into its unsharded fp32 gradient (accumulate_fsdp). False where autograd must take the
        gradient instead."""
        fsdp_param = self.fsdp.param_of(weight) if self.fsdp is not None else None
        if fsdp_param is not None:
            return self.accumulate_fsdp(fsdp_param, weight, grad, inputs)
        local = _local_product_ok(weight, grad, inputs, weight.grad)
        if local is None:
            self.stats["fallback"] += 1
            accumulate_into_grad(weight, _weight_grad(grad, inputs, weight))
            return True
        created = self._fused(weight, local)
        if created is not None:
            weight.grad = created
        return True

    def accumulate_fsdp(self, fsdp_param, weight: torch.Tensor, grad: torch.Tensor, inputs: torch.Tensor) -> bool:
        """Into FSDP2's `unsharded_accumulated_grad` of the gathered `weight`, created here where its
        group does not reduce-scatter after this backward; False (autograd's bf16 gradient, as
        unfused) where it would reduce-scatter with no buffer yet, or the local product is not this
        rank's gradient."""
        held = fsdp_param.unsharded_accumulated_grad
        if held is None and self.fsdp.reduces(fsdp_param):
            return False
        local = _local_product_ok(weight, grad, inputs, held)
        if local is None:
            self.stats["fallback"] += 1
            return False
        created = self._fused(weight, local)
        if created is not None:
            fsdp_param.unsharded_accumulated_grad = created
        return True

    def _fused(self, weight: torch.Tensor, local: tuple) -> torch.Tensor | None:
        """Adds this product into the fp32 accumulator; where there was none, returns a new one (a
        DTensor placed as `weight`)."""
        rows, columns, held = local
        self.stats["fused"] += 1
        if held is not None:
            self._add(held, rows.t(), columns)
            return None
        total = self._first(rows.t(), columns)
        return DTensor.from_local(total, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride()) if isinstance(weight, DTensor) else total

    def _first(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cuda":
            return torch.mm(left, right, out_dtype=torch.float32)
        return left.float().mm(right.float())

    def _add(self, accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        if self.kernel == "cuda":
            torch.addmm(accumulator, left, right, out_dtype=torch.float32, out=accumulator)
        else:
            accumulator.addmm_(left.float(), right.float())


def _local_product_ok(weight, grad, inputs, held):
    """(dY rows, X rows, the local tensor of `held` (the fp32 accumulator) or None for a first
    gradient) where the local product is this rank's shard of the weight's gradient, else None."""
    if isinstance(weight, DTensor):
        if not isinstance(grad, DTensor) or not isinstance(inputs, DTensor):
            return None
        if not local_weight_grad(to_plan_placement(inputs.placements[0]), to_plan_placement(weight.placements[0]),
                                 to_plan_placement(grad.placements[0]), inputs.ndim):
            return None
        if held is not None and (not isinstance(held, DTensor) or held.placements != weight.placements):
            return None
        grad, inputs = grad.to_local(), inputs.to_local()
        held = held.to_local() if held is not None else None
    if held is not None and (held.dtype != torch.float32 or not held.is_contiguous()):
        return None
    return grad.reshape(-1, grad.shape[-1]), inputs.reshape(-1, inputs.shape[-1]), held


class FsdpGradients:
    """The FSDPParams of fully_shard modules by their gathered (unsharded) parameter. FSDP2 makes
    that parameter on its first all-gather and keeps the object after, so the map is filled on a
    miss. Uses FSDP2's private state; where it is absent nothing is found ("fallback" counted once)."""

    def __init__(self, modules, stats: Counter) -> None:
        self.groups = []
        for module in modules:
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None)
            if group is not None:
                self.groups.append(group)
        self.usable = bool(self.groups) and all(
            hasattr(group, "fsdp_params") and hasattr(group, "reduce_grads") and all(
                hasattr(fsdp_param, "unsharded_accumulated_grad") for fsdp_param in group.fsdp_params)
            for group in self.groups)
        if not self.usable:
            stats["fallback"] += 1
        self._found: dict[int, tuple] = {}
        """id(gathered parameter) -> (parameter, FSDPParam, its group)."""
        self._complete = False
        """Every FSDPParam's gathered parameter is in _found (made on the first all-gather, kept after)."""

    def param_of(self, value):
        """The FSDPParam whose gathered parameter `value` is, else None."""
        if not self.usable or not isinstance(value, torch.nn.Parameter) or value.dtype not in _FUSED_DTYPES:
            return None
        found = self._found.get(id(value))
        if (found is None or found[0] is not value) and not self._complete:
            self._refresh()
            found = self._found.get(id(value))
        return found[1] if found is not None and found[0] is value else None

    def reduces(self, fsdp_param) -> bool:
        """Whether the FSDPParam's group reduce-scatters after this backward (gradient sync on)."""
        return bool(self._found[id(fsdp_param._unsharded_param)][2].reduce_grads)

    def _refresh(self) -> None:
        fsdp_params = [(fsdp_param, group) for group in self.groups for fsdp_param in group.fsdp_params]
        self._found = {id(fsdp_param._unsharded_param): (fsdp_param._unsharded_param, fsdp_param, group)
                       for fsdp_param, group in fsdp_params if hasattr(fsdp_param, "_unsharded_param")}
        self._complete = len(self._found) == len(fsdp_params)


class FusedLinear(torch.autograd.Function):
    """`aten.linear(inputs, copy, bias)` whose backward accumulates the weight's gradient into the
    fp32 `weight.grad` itself, or FSDP2's fp32 unsharded gradient (FusedWgrad.accumulate), and
    hands autograd none for it (its own where accumulate declines)."""

    @staticmethod
    def forward(ctx, inputs, weight, copy, bias, runner: FusedWgrad):
        ctx.save_for_backward(inputs, copy)
        ctx.weight, ctx.runner, ctx.has_bias = weight, runner, bias is not None
        return LINEAR(inputs, copy, bias)

    @staticmethod
    def backward(ctx, grad):
        inputs, copy = ctx.saved_tensors
        grad_inputs = grad.matmul(copy) if ctx.needs_input_grad[0] else None
        grad_bias = grad.sum(dim=tuple(range(grad.ndim - 1))) if ctx.has_bias and ctx.needs_input_grad[3] else None
        with torch.no_grad():
            taken = ctx.runner.accumulate(ctx.weight, grad, inputs)
        grad_weight = None if taken or not ctx.needs_input_grad[1] else _weight_grad(grad, inputs, ctx.weight)
        return grad_inputs, grad_weight, None, grad_bias, None


def _weight_grad(grad: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`grad^T @ inputs` (batch dims flattened) placed as `weight`: the gradient autograd would give."""
    product = grad.reshape(-1, grad.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))
    if isinstance(product, DTensor) and isinstance(weight, DTensor):
        product = product.redistribute(weight.device_mesh, weight.placements)
    return product

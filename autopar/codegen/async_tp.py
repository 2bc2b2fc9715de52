"""Async tensor parallelism: sequence-parallel collectives fused with the GEMMs they feed.

Under sequence parallelism a column-parallel linear (input planned "R", weight "S0", output
"S<last>") reads an input sharded by sequence, which DTensor all-gathers before the GEMM; a
row-parallel linear (input "S<last>", weight "S1", output "P") is followed by a reduce-scatter
into the sequence shards its readers want. Both collectives run exposed. torch's async TP
(`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter` over a group with
symmetric memory, `torch.distributed._symmetric_memory`; torchtitan's `--parallelism.
enable_async_tensor_parallel`) decomposes each collective into its tp ring steps and runs the
GEMM on each chunk while the next transfers (Wang et al., ASPLOS 2023), as Megatron's TP overlap
does; solver/tp_overlap.py prices that. Here such a linear runs as one autograd Function:

- column: forward (A, Y) = all_gather(x) then A @ W^T; backward dX = reduce_scatter(dY @ W)
  (plus the gradients of A's other readers, summed first), dW = dY^T A;
- row: forward Y = reduce_scatter(x @ W^T) (+ bias); backward (G, dX) = all_gather(dY) then
  G @ W, dW = G^T x, dbias = sum of G.

The gathered A also serves the other linears that read the same input (q, k and v; gate and
up), as the interpreter's cache of redistributed inputs does. Kernels:

- "cuda": torch's symmetric-memory ops (CUDA, NCCL; not runnable on this project's CPU CI);
- "emulate": the same decomposition with plain collectives (torch's functional all_gather_single then
  matmul, matmul then reduce_scatter_single), on any backend, for tests on gloo;
- "off": DTensor's path.

When the gathered A has other readers, their gradients arrive summed by autograd, so the column
backward's reduce-scatter runs after the local sum, unfused (one collective, as DTensor's); fusing
it would need the sibling linears run as one (torch's op takes several B) -- not done. Weight
gradients of bf16 step copies go through codegen/fused_wgrad.py where it runs. Precision fp8
(torchao's float8 linears) keeps DTensor's path (codegen/build.py).

`AUTOPAR_ASYNC_TP` (off | emulate | cuda) overrides the default ("cuda" on CUDA devices for a plan
with tp_overlap "async", else "off"). A linear that looks like one of the two but does not meet
the rule (another placement, kwargs, a plan input it cannot see, the "gathers" recomputation's
hook) keeps DTensor's path and is counted as a "fallback" (RunStats.async_tp).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.codegen.fused_wgrad import forced_kernel
from autopar.codegen.placements import current

KERNELS = ("off", "emulate", "cuda")
LINEAR = torch.ops.aten.linear.default
_ENV = "AUTOPAR_ASYNC_TP"


def chosen_kernel(device: torch.device, tp_overlap: str) -> str:
    """`AUTOPAR_ASYNC_TP` if set, else "cuda" on a CUDA device for a plan whose tp_overlap is
    "async" (and torch has the symmetric-memory ops), else "off"."""
    forced = forced_kernel(_ENV, KERNELS, "an async TP kernel")
    if forced:
        return forced
    if tp_overlap == "async" and device.type == "cuda" and hasattr(torch.ops, "symm_mem") and \
            hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return "cuda"
    return "off"


def _enable_symm_mem(group_name: str) -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)


def _shard_dim(value) -> int | None:
    """The dim a one-axis DTensor is sharded on (non-negative), else None."""
    if not isinstance(value, DTensor) or len(value.placements) != 1 or not value.placements[0].is_shard():
        return None
    return value.placements[0].dim % value.ndim


class AsyncTP:
    """Runs a rank's sequence-parallel linears with their collectives fused into the GEMM."""

    def __init__(self, mesh, kernel: str, stats: Counter | None = None, fused_wgrad=None) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown async TP kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        self.mesh = mesh
        self.kernel = kernel
        self.stats = Counter() if stats is None else stats
        """"column" and "row" (fused), "shared" (a gathered input reused), "fallback" counts."""
        self.group = mesh.get_group() if kernel != "off" else None
        self.fused_wgrad = fused_wgrad
        """FusedWgrad (codegen/fused_wgrad.py) that accumulates these linears' weight gradients, if any."""
        if kernel == "cuda":
            try:
                _enable_symm_mem(self.group.group_name)
            except Exception as error:  # noqa: BLE001 - any failure of the CUDA path falls back, said once
                self._fall_back(error)

    def _fall_back(self, error: Exception) -> None:
        """The fused CUDA kernels failed (symmetric memory unsupported here, a shape they refuse):
        run the same decomposition with plain collectives from now on, exposed as DTensor's are
        (the plan priced them hidden), and say so once."""
        import warnings

        warnings.warn(f"async TP: torch's fused symmetric-memory kernels failed ({type(error).__name__}: {error}); "
                      "the sequence-parallel collectives run unfused from here on, slower than the plan predicts "
                      "(plan with --tp-overlap off to price them so)", RuntimeWarning, stacklevel=3)
        self.kernel = "emulate"
        self.stats["cuda_failed"] += 1

    # --- the two collectives, fused (cuda) or not (emulate) -------------------------------------

    def gather_matmul(self, shard: torch.Tensor, right: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_gather(shard) on `dim`, that @ right)."""
        if self.kernel == "cuda":
            try:
                gathered, (product,) = torch.ops.symm_mem.fused_all_gather_matmul(
                    shard, [right], dim, self.group.group_name, return_A=True)
                return gathered, product
            except Exception as error:  # noqa: BLE001 - see _fall_back
                self._fall_back(error)
        gathered = all_gather(shard, dim, self.group)
        return gathered, gathered.matmul(right)

    def matmul_scatter(self, left: torch.Tensor, right: torch.Tensor, dim: int) -> torch.Tensor:
        """reduce_scatter(left @ right) on `dim` (sum)."""
        if self.kernel == "cuda":
            try:
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(left, right, "sum", dim, self.group.group_name)
            except Exception as error:  # noqa: BLE001 - see _fall_back
                self._fall_back(error)
        return reduce_scatter(left.matmul(right), dim, self.group)

    # --- the interpreter's hook ------------------------------------------------------------------

    def run(self, node, interpreter, env: dict, cache: dict, output_placement, input_placements):
        """The output of linear `node` run fused, or None for the interpreter's own path."""
        if self.kernel == "off" or node.target is not LINEAR or len(node.args) < 2 or \
                node.target in interpreter.overrides:
            return None
        source = node.args[0]
        value = env.get(source.name) if isinstance(source, torch.fx.Node) else None
        wanted = list(input_placements)
        shard_dim = _shard_dim(value)
        column = shard_dim is not None and shard_dim < value.ndim - 1 and wanted[:1] == ["R"]
        row = output_placement == "P" and wanted[:1] == [f"S{getattr(value, 'ndim', 0) - 1}"]
        scatter_dim = _readers_shard_dim(node, interpreter.placements) if row else None
        if not column and scatter_dim is None:
            return None
        if column and (source.name, "R") in cache:
            self.stats["shared"] += 1
            return None
        operands = [arg for arg in node.args if arg is not None]  # linear(x, w, None): no bias
        ok = not node.kwargs and interpreter.on_gather is None and len(wanted) == len(operands) and \
            all(isinstance(arg, torch.fx.Node) for arg in operands) and isinstance(value, DTensor)
        weights = [interpreter.place(env[arg.name], placement) for arg, placement in zip(operands[1:], wanted[1:])] \
            if ok else []
        size = self.mesh.size()
        even = isinstance(value, DTensor) and value.shape[shard_dim if column else scatter_dim] % size == 0
        ok = ok and even
        if column:
            ok = ok and output_placement == f"S{value.ndim - 1}" and _placed(weights, ("S0", "S0"))
        else:
            ok = ok and _placed(weights, ("S1", "R"))
        if not ok:
            self.stats["fallback"] += 1
            return None
        weight, bias = weights[0], (weights[1] if len(weights) > 1 else None)
        master = _fused_master(self.fused_wgrad, weight, value)
        if master is not None and master is not weight:  # into master.grad: none through the copy's cast
            weight = weight.detach()
        if column:
            self.stats["column"] += 1
            out, gathered = _ColumnLinear.apply(value, weight, bias, self, shard_dim, master)
            cache[(source.name, "R")] = gathered
            return out
        self.stats["row"] += 1
        return _RowLinear.apply(value, weight, bias, self, scatter_dim, master)


def _fused_master(fused_wgrad, weight: DTensor, inputs: DTensor):
    """The fp32 weight whose bf16 step copy `weight` is, where codegen/fused_wgrad.py accumulates
    its gradient inside the GEMM (FusedWgrad.accumulate, from this module's backward), else None.
    Both linears here are column- or row-parallel: the local product is the rank's shard."""
    if fused_wgrad is None or fused_wgrad.kernel == "off":
        return None
    master = fused_wgrad.master_of(weight)
    if master is None or weight.dtype not in (torch.bfloat16, torch.float16) or inputs.dtype != weight.dtype:
        return None
    return master


def _weight_grad(ctx, grad: Callable[[], DTensor], inputs: Callable[[], DTensor], local_grad: Callable[[], DTensor]):
    """The weight's gradient for autograd (`local_grad`), or None where FusedWgrad accumulated it into
    the fp32 master's .grad (or FSDP2's fp32 unsharded gradient) itself, from the `grad` and `inputs`
    DTensors its placement check reads."""
    if ctx.master is None:
        return local_grad()
    with torch.no_grad():
        taken = ctx.runner.fused_wgrad.accumulate(ctx.master, grad(), inputs())
    return None if taken else local_grad()


def _placed(values, placements) -> bool:
    return all(isinstance(value, DTensor) and len(value.placements) == 1 and current(value) == placement
               for value, placement in zip(values, placements))


def _readers_shard_dim(node, placements: dict) -> int | None:
    """The sequence dim every reader of `node` wants its output sharded on (not the last), else None."""
    dims = set()
    ndim = node.meta["val"].ndim if isinstance(node.meta.get("val"), torch.Tensor) else None
    for reader in node.users:
        if reader.op != "call_function" or reader.name not in placements or ndim is None:
            return None
        wanted = placements[reader.name][1]
        positions = [position for position, arg in enumerate(_tensor_args(reader)) if arg is node]
        if not positions or len(_tensor_args(reader)) != len(wanted):
            return None
        for position in positions:
            if not wanted[position].startswith("S"):
                return None
            dims.add(int(wanted[position][1:]) % ndim)
    return dims.pop() if len(dims) == 1 and next(iter(dims)) < ndim - 1 else None


def _tensor_args(node) -> list:
    """The tensor arguments of `node`, in the interpreter's order (args, then kwargs)."""
    found = []

    def visit(arg):
        if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor):
            found.append(arg)
        return arg

    torch.fx.node.map_aggregate(node.args, visit)
    torch.fx.node.map_aggregate(dict(node.kwargs), visit)
    return found


# --- plain collectives on a dim -------------------------------------------------------------------

def all_gather(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' shards concatenated on `dim`. Functional collectives, as DTensor's: the "op"
    recomputation's selective checkpoint refuses an in-place collective's output buffer."""
    return _waited(funcol.all_gather_single(shard.contiguous(), dim, group)).contiguous()


def reduce_scatter(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk on `dim` of the ranks' sum of `full`."""
    return _waited(funcol.reduce_scatter_single(full.contiguous(), "sum", dim, group)).contiguous()


def _waited(value: torch.Tensor) -> torch.Tensor:
    return value.wait() if isinstance(value, funcol.AsyncCollectiveTensor) else value


def _rows(value: torch.Tensor) -> torch.Tensor:
    return value.reshape(-1, value.shape[-1])


def _local(value, placement) -> torch.Tensor:
    if isinstance(value, DTensor) and value.placements[0] != placement:
        value = value.redistribute(value.device_mesh, [placement])
    return value.to_local() if isinstance(value, DTensor) else value


def _wrap(local: torch.Tensor, like: DTensor, placement, shape) -> DTensor:
    return DTensor.from_local(local.contiguous(), like.device_mesh, [placement], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


class _ColumnLinear(torch.autograd.Function):
    """linear(all_gather(x), W, b) with W, b column-sharded; returns (Y sharded on its last dim, A)."""

    @staticmethod
    def forward(ctx, x, weight, bias, runner: AsyncTP, dim: int, master=None):
        weight_local = weight.to_local()
        gathered, product = runner.gather_matmul(x.to_local(), weight_local.t(), dim)
        if bias is not None:
            product = product + bias.to_local()
        ctx.save_for_backward(gathered, weight_local)
        ctx.runner, ctx.dim, ctx.has_bias, ctx.like, ctx.master = runner, dim, bias is not None, x, master
        ctx.set_materialize_grads(False)  # A without other readers: no gradient, the fused reduce-scatter
        out_shape = (*x.shape[:-1], weight.shape[0])
        out = _wrap(product, x, Shard(x.ndim - 1), out_shape)
        whole = _wrap(gathered, x, Replicate(), x.shape)
        return out, whole

    @staticmethod
    def backward(ctx, grad_out, grad_whole):
        gathered, weight_local = ctx.saved_tensors
        runner, dim, like = ctx.runner, ctx.dim, ctx.like
        grad_local = _local(grad_out, Shard(grad_out.ndim - 1)) if grad_out is not None else \
            gathered.new_zeros((*gathered.shape[:-1], weight_local.shape[0]))
        after = None
        if grad_whole is None:
            grad_x = runner.matmul_scatter(grad_local, weight_local, dim)
        else:
            summed = grad_local.matmul(weight_local)
            if isinstance(grad_whole, DTensor) and isinstance(grad_whole.placements[0], Partial):
                summed = summed + grad_whole.to_local()
            elif isinstance(grad_whole, DTensor):  # a whole gradient: this rank's chunk is added after the sum
                after = _local(grad_whole, Shard(dim))
            else:
                after = grad_whole.chunk(runner.mesh.size(), dim)[runner.mesh.get_local_rank()]
            grad_x = reduce_scatter(summed, dim, runner.group)  # not fused: the sum comes first
            if after is not None:
                grad_x = grad_x + after
        size = runner.mesh.size()
        grad_weight = _weight_grad(
            ctx, lambda: _wrap(grad_local, like, Shard(like.ndim - 1), (*like.shape[:-1], grad_local.shape[-1] * size)),
            lambda: _wrap(gathered, like, Replicate(), like.shape),
            lambda: _wrap(_rows(grad_local).t().mm(_rows(gathered)), like, Shard(0),
                          (grad_local.shape[-1] * size, gathered.shape[-1])))
        grad_bias = _rows(grad_local).sum(0) if ctx.has_bias else None
        return (_wrap(grad_x, like, Shard(dim), like.shape), grad_weight,
                _wrap(grad_bias, like, Shard(0), (grad_bias.shape[0] * runner.mesh.size(),))
                if grad_bias is not None else None, None, None, None)


class _RowLinear(torch.autograd.Function):
    """reduce_scatter(linear(x, W)) + b with x, W row-sharded, b replicated; Y sharded on `dim`."""

    @staticmethod
    def forward(ctx, x, weight, bias, runner: AsyncTP, dim: int, master=None):
        x_local, weight_local = x.to_local(), weight.to_local()
        product = runner.matmul_scatter(x_local, weight_local.t(), dim)
        if bias is not None:
            product = product + bias.to_local()
        ctx.save_for_backward(x_local, weight_local)
        ctx.runner, ctx.dim, ctx.has_bias, ctx.like, ctx.master = runner, dim, bias is not None, x, master
        return _wrap(product, x, Shard(dim), (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        x_local, weight_local = ctx.saved_tensors
        runner, dim, like = ctx.runner, ctx.dim, ctx.like
        gathered, grad_x = runner.gather_matmul(_local(grad_out, Shard(dim)).contiguous(), weight_local, dim)
        grad_weight = _weight_grad(
            ctx, lambda: _wrap(gathered, like, Replicate(), (*like.shape[:-1], gathered.shape[-1])),
            lambda: _wrap(x_local, like, Shard(like.ndim - 1), like.shape),
            lambda: _wrap(_rows(gathered).t().mm(_rows(x_local)), like, Shard(1),
                          (gathered.shape[-1], x_local.shape[-1] * runner.mesh.size())))
        grad_bias = _rows(gathered).sum(0) if ctx.has_bias else None
        return (_wrap(grad_x, like, Shard(like.ndim - 1), like.shape), grad_weight,
                _wrap(grad_bias, like, Replicate(), grad_bias.shape) if grad_bias is not None else None,
                None, None, None)

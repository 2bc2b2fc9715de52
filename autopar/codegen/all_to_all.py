"""Shard(d) -> Shard(d') on the tensor-parallel axis as one all-to-all, on every backend.

The planner prices moving a tensor's shard from one dim to another (a sequence-parallel
activation entering a hidden-sharded op, or back) as an all-to-all: each device sends 1/n of
its shard to each other device (solver/costing.py). DTensor runs that collective on NCCL
(`shard_dim_alltoall`), but on a CPU mesh (gloo) torch 2.13 falls back to an all-gather of the
whole tensor and a local slice (torch/distributed/tensor/_collective_utils.py: "CPU process group
does not support alltoall yet"): n times the bytes, and another collective than the plan's. Gloo
does run all_to_all_single, so there codegen runs the priced all-to-all itself, through the
functional collective (what DTensor's debug counters and traces see); its backward is the
reverse all-to-all, as DTensor's is on NCCL. On other devices DTensor's own redistribution runs.

Shards follow DTensor's layout (torch.chunk: the last devices may hold fewer rows, or none), so
uneven dims work too: each piece is sent flattened with its own size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard


def runs_own_all_to_all(value: DTensor, target) -> bool:
    """Whether `value` -> `target` is a shard-dim change that DTensor would all-gather (CPU mesh)."""
    current = value.placements[0] if len(value.placements) == 1 else None
    return (value.device_mesh.device_type == "cpu" and value.device_mesh.ndim == 1
            and type(current) is Shard and type(target) is Shard and current.dim != target.dim)


def shard_to_shard(value: DTensor, dim: int) -> DTensor:
    """`value` (Shard(d) on a one-axis mesh) resharded to Shard(dim) by an all-to-all."""
    return _ShardToShard.apply(value, dim)


class _ShardToShard(torch.autograd.Function):
    """Forward: all-to-all d -> d'. Backward: the reverse all-to-all for a gradient sharded as
    the output was (its usual form), else DTensor's redistribution of it, as DTensor's own
    Redistribute backward does."""

    @staticmethod
    def forward(ctx, value: DTensor, dim: int) -> DTensor:
        ctx.source = value.placements[0]
        return _exchanged(value, dim)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if runs_own_all_to_all(grad, ctx.source):
            return _exchanged(grad, ctx.source.dim), None
        return grad.redistribute(grad.device_mesh, [ctx.source]), None


def _exchanged(value: DTensor, dim: int) -> DTensor:
    mesh, source = value.device_mesh, value.placements[0].dim
    local = _all_to_all(value.to_local(), tuple(value.shape), source, dim, mesh)
    stride = tuple(math.prod(value.shape[i + 1:]) for i in range(len(value.shape)))
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=value.shape, stride=stride)


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Rows of each device's shard of a dim of `size` rows (DTensor's torch.chunk layout)."""
    rows = -(-size // parts) if size else 0
    return [max(0, min(rows, size - rows * index)) for index in range(parts)]


def _all_to_all(local: torch.Tensor, full_shape: tuple[int, ...], source: int, target: int, mesh) -> torch.Tensor:
    """This device's shard on dim `target` from its shard on dim `source` (plain tensors)."""
    parts, rank = mesh.size(0), mesh.get_local_rank(0)
    source_rows, target_rows = chunk_sizes(full_shape[source], parts), chunk_sizes(full_shape[target], parts)
    pieces = [piece.contiguous().reshape(-1) for piece in local.split(target_rows, dim=target)]
    incoming = []
    for sender in range(parts):
        shape = list(local.shape)
        shape[source], shape[target] = source_rows[sender], target_rows[rank]
        incoming.append(shape)
    received = funcol.all_to_all_single(torch.cat(pieces), [math.prod(shape) for shape in incoming],
                                        [piece.numel() for piece in pieces], (mesh, 0))
    if isinstance(received, funcol.AsyncCollectiveTensor):
        received = received.wait()
    blocks = received.split([math.prod(shape) for shape in incoming])
    return torch.cat([block.view(shape) for block, shape in zip(blocks, incoming)], dim=source)

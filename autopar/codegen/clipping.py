"""Gradient clipping by the whole model's norm, over every rank's shards.

On one device, `clip_grad_norm_` computes the 2-norm of all gradients concatenated. Here each
rank holds pieces: tensor-parallel and FSDP shards (distinct parts of one gradient), data-
parallel and tensor-parallel replicas (identical copies), pipeline stages (distinct parameters)
and tied weights held on several stages (identical copies after their all-reduce). Every rank
sums the squares of its local pieces, each divided by the number of ranks holding that same
piece, and one all-reduce over the world gives the exact total: each element is counted once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from autopar.codegen.data_parallel import reduce_partial_gradients
from autopar.errors import ConfigError


def clip_grad_norm(module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    if norm_type not in (2.0, math.inf):
        raise ConfigError(f"clip_grad_norm_ supports norm_type 2 and inf, got {norm_type}")
    world = dist.get_world_size()
    pipeline = module.plan.mesh["pp"]
    device = module.runtime.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    params = module.named_model_parameters()
    reduce_partial_gradients(params.values())  # train_step did; a gradient made outside it may be partial
    for fqn, param in params.items():
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grads.append(local)
        if norm_type == math.inf:
            total = torch.maximum(total, local.detach().abs().max().double()) if local.numel() else total
            continue
        holders = world // pipeline * _stage_copies(module, fqn)
        total += local.detach().double().pow(2).sum() / (holders // _distinct_pieces(param.grad))
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
    norm = total if norm_type == math.inf else total.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
    return norm.float()


def _stage_copies(module, fqn: str) -> int:
    group = module.tied_groups.get(fqn)
    return dist.get_world_size(group) if group is not None else 1


def _distinct_pieces(grad: torch.Tensor) -> int:
    if not isinstance(grad, DTensor):
        return 1
    pieces = 1
    for size, placement in zip(grad.device_mesh.mesh.shape, grad.placements):
        if isinstance(placement, Shard):
            pieces *= int(size)
    return pieces

"""Ops that DTensor cannot run, run on each device's local tensors.

Two kinds:
  - ops with a rule of ours but no DTensor strategy (grouped expert matmuls, the per-expert bias
    after them): run on the local shards with the plan's placements, which the rule says are
    exact (strategies/grouped_mm.py);
  - ops without any sharding strategy in DTensor (`aten.lift_fresh_copy`, a library's custom
    op): run replicated, as the planner assumed for an op without a rule: every input is
    gathered, every device computes the whole op, and the output is a replicated DTensor.

Autograd runs through `to_local` / `from_local`. A replicated input of an op whose work is split
(column- or expert-parallel) gets a partial gradient on each device, so its `to_local` says so.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.fx.node import map_aggregate

from autopar.codegen.placements import to_dtensor_placement
from autopar.strategies.grouped_mm import EXPERT_BIAS_TARGETS, GROUPED_MM_TARGETS

_GROUPED_MM = frozenset(GROUPED_MM_TARGETS)
_EXPERT_BIAS = frozenset(EXPERT_BIAS_TARGETS)


def has_local_rule(target) -> bool:
    return str(target) in _GROUPED_MM or str(target) in _EXPERT_BIAS


def run_sharded(target, args: tuple, kwargs: dict, mesh, output_placement: str):
    """Run a grouped matmul on local shards placed as the plan says (col, row or expert), or a
    per-expert bias on its columns' shards (col)."""
    if str(target) in _EXPERT_BIAS:
        output = target(*(_local(value, partial_grad=False) for value in args), **kwargs)
        return DTensor.from_local(output, mesh, [to_dtensor_placement(output_placement)], run_check=False)
    tokens, weight, offsets, *rest = args
    weight_split = isinstance(weight, DTensor) and weight.placements[0] in (_shard(0), _shard(2))
    local = [_local(value, partial_grad=weight_split) for value in (tokens, weight, offsets)]
    if isinstance(weight, DTensor) and weight.placements[0] == _shard(0):
        output = _grouped_mm_own_experts(target, *local, mesh.get_local_rank(), rest, kwargs)
    else:
        output = target(*local, *rest, **kwargs)
    return DTensor.from_local(output, mesh, [to_dtensor_placement(output_placement)], run_check=False)


def run_replicated(target, args: tuple, kwargs: dict, mesh):
    """Run an op without a DTensor strategy on whole tensors, the same on every device."""

    def whole(value):
        if isinstance(value, DTensor):
            return value.redistribute(mesh, [Replicate()]).to_local()
        return value

    output = target(*map_aggregate(args, whole), **map_aggregate(kwargs, whole))
    return map_aggregate(output, lambda value: DTensor.from_local(value, mesh, [Replicate()], run_check=False)
                         if isinstance(value, torch.Tensor) else value)


def no_dtensor_strategy(error: Exception) -> bool:
    return isinstance(error, NotImplementedError) and "sharding strategy" in str(error)


def _grouped_mm_own_experts(target, tokens, weight, offsets, rank: int, rest, kwargs):
    """This device's experts (a contiguous block of `weight`'s dim 0) on their rows, zeros on
    the other rows: summed over the devices, the whole grouped matmul."""
    num_local = weight.shape[0]
    first = rank * num_local
    bounds = torch.cat([offsets.new_zeros(1), offsets])
    start, end = int(bounds[first]), int(bounds[first + num_local])
    rows = target(tokens[start:end], weight, offsets[first:first + num_local] - start, *rest, **kwargs)
    before = rows.new_zeros(start, rows.shape[1])
    after = rows.new_zeros(tokens.shape[0] - end, rows.shape[1])
    return torch.cat([before, rows, after])


def _local(value, *, partial_grad: bool):
    if not isinstance(value, DTensor):
        return value
    replicated = isinstance(value.placements[0], Replicate)
    if partial_grad and replicated and value.requires_grad:
        return value.to_local(grad_placements=[Partial()])
    return value.to_local()


def _shard(dim: int):
    return to_dtensor_placement(f"S{dim}")

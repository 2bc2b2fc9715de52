"""Placements on one mesh axis, in DTensor's vocabulary, as short strings.

    "R"    Replicate: every device on the axis holds the whole tensor
    "S<d>" Shard(d): the tensor is split evenly along dim d
    "P"    Partial(sum): every device holds a partial value; the tensor is their sum

Strings keep strategies hashable, JSON-friendly and cheap to compare in the solver.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLICATE = "R"
PARTIAL = "P"


def shard(dim: int) -> str:
    return f"S{dim}"


def is_shard(placement: str) -> bool:
    return placement.startswith("S")


def shard_dim(placement: str) -> int:
    return int(placement[1:])


def shards_on_dim(placements: Sequence[str], dim: int, mesh_shape: Sequence[int]) -> int:
    """How many pieces dim `dim` is split into by all mesh axes."""
    count = 1
    for placement, size in zip(placements, mesh_shape):
        if placement == shard(dim):
            count *= size
    return count


def local_shape(shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-device shape of a tensor with these per-axis placements (even sharding)."""
    sizes = list(shape)
    for placement, size in zip(placements, mesh_shape):
        if is_shard(placement):
            dim = shard_dim(placement)
            sizes[dim] = -(-sizes[dim] // size)
    return tuple(sizes)


def shard_factor(placements: Sequence[str], mesh_shape: Sequence[int]) -> int:
    """By how much sharding divides the tensor's size per device."""
    factor = 1
    for placement, size in zip(placements, mesh_shape):
        if is_shard(placement):
            factor *= size
    return factor


def transition(source: str, target: str) -> str | None:
    """The collective that turns `source` into `target` on one axis (None: local or free)."""
    if source == target:
        return None
    if source == PARTIAL:
        return "all_reduce" if target == REPLICATE else "reduce_scatter"
    if is_shard(source):
        if target == REPLICATE:
            return "all_gather"
        if is_shard(target):
            return "all_to_all"
        return "all_gather"  # Shard -> Partial goes through Replicate
    return None  # Replicate -> Shard is a local slice; Replicate -> Partial is free


def grad_placement(placement: str) -> str:
    """Placement the gradient of a tensor must reach: a partial output's gradient is replicated."""
    return REPLICATE if placement == PARTIAL else placement


def local_weight_grad(inputs: str, weight: str, output: str, input_ndim: int) -> bool:
    """Whether a linear's weight gradient computed on each device's local tensors (dY^T @ X, batch
    dims flattened) is exactly that device's shard of the weight's gradient, on one mesh axis:
    everything replicated, column-parallel (weight S0, input replicated, output sharded on its
    last dim) or row-parallel (weight S1, input sharded on its last dim, output partial, whose
    gradient is replicated). `output` may be the gradient's placement instead (grad_placement)."""
    last = shard(input_ndim - 1)
    return (weight, inputs, grad_placement(output)) in {(REPLICATE, REPLICATE, REPLICATE), (shard(0), REPLICATE, last),
                                                         (shard(1), last, REPLICATE)}


def describe(placements: Sequence[str], axis_names: Sequence[str]) -> str:
    return ",".join(f"{name}:{placement}" for name, placement in zip(axis_names, placements))


def boundary_wire(shape: Sequence[int], placement: str, tp: int, *, floating: bool = True) -> str:
    """How an activation crossing a pipeline boundary travels (Megatron-LM's scatter/gather, SC21
    section 4.1): a floating-point tensor replicated over tp ranks is sent as each rank's 1/tp
    slice, Shard on its first dim that tp divides, and all-gathered on arrival; any other tensor
    as it is placed."""
    if placement != REPLICATE or tp <= 1 or not floating:
        return placement
    dim = next((dim for dim, size in enumerate(shape) if size % tp == 0 and size >= tp), None)
    return placement if dim is None else shard(dim)

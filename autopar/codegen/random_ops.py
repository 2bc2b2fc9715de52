"""Random ops under tensor parallelism: every tp rank draws what one process would draw.

A random op (dropout, rand_like, bernoulli, the in-place fills exponential_/uniform_/normal_,
attention with dropout) run on DTensors draws on each rank's local tensor from that rank's own
generator. Ranks whose generators differ compute different values for a replicated tensor: the
tp ranks then train different models, silently. Ranks whose generators agree draw the same
numbers for every shard of a sharded tensor: one local mask repeated tp times, not the mask one
process draws. DTensor's OffsetBasedRNGTracker answers the second on CUDA only, for DTensor's own
list of random ops (not exponential_, nor an op run on local tensors).

Here, on every device type:
  - `GeneratorSync`: at the start of every step (train_step, eval_step, pm(...)) the first tp
    rank's default generator states (CPU, and the accelerator's) are broadcast over its tp
    group. The group's ranks run the same random ops at the same global shapes, so their
    generators then advance in lockstep through the step (a recomputed region restores its
    state as torch.utils.checkpoint does). A resumed job (training_loop restores each rank's own
    saved state) is made consistent by the first step's sync.
  - `run_random`: each random op on DTensors draws the global shape, as one process would, and
    each rank keeps its planned shard. Dropout draws its scaled mask as dropout of ones (the
    same draws and the same roundings as the op on the whole input: x * (mask / (1 - p)), mask in
    {0, 1}); in-place fills fill a tensor of the global shape and copy this rank's slice in; the
    `*_like` draws take an empty tensor of the global shape; attention with dropout on CPU runs
    its math kernel on the shards with each random fill inside it drawn so (`global_draws`); any
    other random op (attention with dropout on CUDA, bernoulli of a tensor of probabilities,
    multinomial) has its inputs gathered and runs whole (counted in RunStats.random_gathered:
    collectives and compute the plan did not price).
So a tp run draws what one process draws from the same generator state. The cost: each tp rank
draws the whole of a sharded random op (tp x its random numbers, and its global-shape mask for
the op's duration); no communication but the sync (one broadcast of ~5 KB per step). On CUDA the
same holds with the CUDA generator (DTensor's tracker is not used: the draws run on local
tensors); that path has not run on a GPU here.

A step's microbatches draw one after another at their own shapes, as one process accumulating
gradients over those microbatches would. Data-parallel replicas, pipeline stages and
context-parallel ranks draw from their own generators for their own samples, layers or tokens,
as under DDP: ranks seeded alike draw alike (Megatron's default, though Megatron offsets its seed
by pipeline rank, so that stages do not repeat their masks; seed per rank for independent
draws). A folded MoE region (codegen/expert_folding.py) and context parallelism's attention under
tp run on each tp rank's plain local tensors from the synced generator: those tp ranks draw the
same numbers for their different tokens or heads. Each such run is a valid run of the model (no
two ranks disagree on a value they share) but not one process's draws; the alternative (each
replica drawing the whole global batch's numbers and keeping its rows) would cost dp x the
random numbers on every rank, so it is not done. `autopar verify` labels such kinds' cells
"random ops: drawn per replica" instead of comparing them.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.fx.node import map_aggregate
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.codegen.placements import to_dtensor_placement
from autopar.errors import PlanMismatchError

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_DROPOUTS = frozenset({aten.dropout.default, aten.native_dropout.default})
"""Dropouts drawn as dropout of ones (args: input, p, train)."""
_SHAPE_ONLY = frozenset({aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                         aten.randint_like.low_dtype, aten.bernoulli.p})
"""Out-of-place random ops whose first input gives only the shape, dtype and device."""


@functools.cache  # asked for every op of every step
def is_random_target(target) -> bool:
    """Whether the op draws from a generator (torch tags it nondeterministic_seeded)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def draws(target, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers: a random op, but not a dropout with p = 0 or out
    of training, nor an attention without dropout."""
    if not is_random_target(target):
        return False
    if target is _SDPA:
        return float(_argument(args, kwargs, 4, "dropout_p", 0.0)) > 0.0
    if target in _DROPOUTS or "dropout" in target.name():
        p = float(_argument(args, kwargs, 1, "p", 0.0))
        train = _argument(args, kwargs, 2, "train", True)
        return p > 0.0 and train is not False
    return True


def random_nodes(graph: torch.fx.Graph) -> list[str]:
    """Names of the nodes of `graph` that draw random numbers (by their static arguments)."""
    return [node.name for node in graph.nodes if node.op == "call_function"
            and draws(node.target, tuple(node.args), dict(node.kwargs))]


def run_random(target, args: tuple, kwargs: dict, mesh, output_placement: str | None, stats=None):
    """The op on DTensors on `mesh`, drawn at the global shape; this rank's planned part of it."""
    wanted = _output_placement(output_placement)
    if target in _DROPOUTS:
        return _dropout(target, args, kwargs, mesh)
    if _fills(target):
        return _fill(target, args, kwargs, mesh)
    if target in _SHAPE_ONLY and isinstance(args[0], DTensor):
        like = args[0]
        whole = target(torch.empty(like.shape, dtype=like.dtype, device=like.to_local().device),
                       *_whole(args[1:], mesh), **_whole(kwargs, mesh))
        return part_of(whole, mesh, wanted)
    if stats is not None:
        if not stats.random_gathered[str(target)]:
            warnings.warn(f"autopar: {target} draws random numbers and has no shard-wise rule under tensor "
                          "parallelism: its inputs are gathered and it runs whole on every tp rank (exact, but "
                          "collectives and compute the plan did not price)", stacklevel=2)
        stats.random_gathered[str(target)] += 1
    result = target(*_whole(args, mesh), **_whole(kwargs, mesh))
    return map_aggregate(result, lambda value: part_of(value, mesh, wanted) if isinstance(value, torch.Tensor)
                         else value)


class global_draws(TorchDispatchMode):
    """Inside a composite op run on DTensors (attention's math kernel with dropout: softmax, then
    dropout as `empty_like` + `bernoulli_`), every random fill of a DTensor draws its global shape
    and keeps this rank's slice (`_fill`), so the op's draws are one process's without gathering
    its inputs; every other op passes through."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _fills(func) and isinstance(args[0], DTensor):
            return _fill(func, args, kwargs, self.mesh)
        return func(*args, **kwargs)


def _fills(target) -> bool:
    """Whether `target` is a random op that overwrites its first argument (exponential_, uniform_...)."""
    if not is_random_target(target):
        return False
    first = target._schema.arguments[0] if target._schema.arguments else None
    return first is not None and first.alias_info is not None and first.alias_info.is_write


def part_of(whole: torch.Tensor, mesh, placement) -> DTensor:
    """This rank's part of `whole` (the same tensor on every rank of `mesh`) as a DTensor placed
    `placement` (Replicate or Shard): a slice, no communication; a copy, so `whole` can go."""
    replicated = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    if not placement.is_shard():
        return replicated
    sharded = replicated.redistribute(mesh, [placement])
    local = sharded.to_local()
    if local.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():  # a view (dim 0): copy
        local = local.clone()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=sharded.shape, stride=sharded.stride())


def _dropout(target, args: tuple, kwargs: dict, mesh):
    """x * (dropout of ones at x's global shape, sliced as x): each element the product one
    process computes. native_dropout also returns its mask (the same slice)."""
    value = args[0]
    if isinstance(value, DTensor) and isinstance(value.placements[0], Partial):
        value = value.redistribute(mesh, [Replicate()])
    placement = value.placements[0] if isinstance(value, DTensor) else Replicate()
    local = value.to_local() if isinstance(value, DTensor) else value
    ones = torch.ones(value.shape, dtype=value.dtype, device=local.device)
    drawn = target(ones, *args[1:], **kwargs)
    if target is aten.native_dropout.default:
        scaled, mask = drawn
        return _times(value, part_of(scaled, mesh, placement), mesh), part_of(mask, mesh, placement)
    return _times(value, part_of(drawn, mesh, placement), mesh)


def _times(value, scaled: DTensor, mesh):
    if not isinstance(value, DTensor):
        value = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value * scaled


def _fill(target, args: tuple, kwargs: dict, mesh):
    """An in-place random fill of args[0] (whose values it overwrites): a global-shape tensor
    filled, this rank's slice copied into args[0]'s local tensor."""
    target_tensor = args[0]
    if not isinstance(target_tensor, DTensor):
        return target(*args, **kwargs)
    placement = target_tensor.placements[0]
    if isinstance(placement, Partial):
        raise PlanMismatchError(f"{target} fills a tensor the plan holds as partial sums: its random values would be "
                                "summed over the tp ranks; plan with the op's input replicated (report this model)")
    local = target_tensor.to_local()
    whole = torch.empty(target_tensor.shape, dtype=target_tensor.dtype, device=local.device)
    target(whole, *_whole(args[1:], mesh), **_whole(kwargs, mesh))
    with torch.no_grad():
        local.copy_(part_of(whole, mesh, placement).to_local())
    return target_tensor


def _whole(values, mesh):
    """Every DTensor in `values` gathered whole (the same plain tensor on every rank)."""
    return map_aggregate(values, lambda value: value.redistribute(mesh, [Replicate()]).to_local()
                         if isinstance(value, DTensor) else value)


def _output_placement(text: str | None):
    """The plan's output placement as a DTensor one; random values are never partial sums."""
    if text is None or text == "P":
        return Replicate()
    return to_dtensor_placement(text)


def _argument(args: tuple, kwargs: dict, position: int, name: str, default):
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


class GeneratorSync:
    """Makes the default generators of a tp group's ranks equal: the first rank's CPU state, and
    its accelerator's when `device` is one, broadcast over `group` (call at each step's start)."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.source = dist.get_global_rank(group, 0)

    def __call__(self) -> None:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        sizes = [state.numel() for state in states]
        flat = torch.cat(states).to(self.device)
        dist.broadcast(flat, src=self.source, group=self.group)
        cpu_state, *device_state = flat.cpu().split(sizes)
        torch.set_rng_state(cpu_state.clone())
        if device_state:
            torch.cuda.set_rng_state(device_state[0].clone(), self.device)

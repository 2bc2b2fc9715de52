"""View family: ops that move, split or join elements without computing on them: view/reshape,
flatten/unflatten, squeeze/unsqueeze, transpose/permute, expand, split/chunk/unbind (+ getitem),
slice/select/narrow, cat/stack, repeat, contiguous.

All of them are linear, so a Partial input gives a Partial output: DTensor passes Partial through
all of them but repeat_interleave (it all-reduces first) and gather. Sharded dims follow DTensor's rules (torch 2.13, `_view_ops.py`, `_tensor_ops.py`):

  - reshape-like ops (view, reshape, flatten, unflatten, squeeze, unsqueeze, view_as) decompose the
    shape change into groups of input dims merged/split into groups of output dims (DTensor's
    `view_groups`). Sharding survives only on the OUTERMOST input dim of a group, and lands on the
    outermost output dim of that group: then both sides cut the group's flattened range into the
    same contiguous chunks. Sharding an inner dim of a merged group makes DTensor produce a
    `_StridedShard` (view) or redistribute (reshape); neither is offered.
  - split/chunk/unbind/slice/select/narrow keep sharding on the dims they do not cut; a slice that
    keeps the whole dim (start 0, end past the size, step 1) also keeps sharding on it.
  - cat/stack need every input in the same placement, never sharded on the cat dim.
  - getitem (selecting one output of split/topk/...) keeps the producer's placement.
  - gather(x, dim, index): index sharded on `dim` with x replicated, or both sharded alike on
    another dim where they have the same size (DTensor also offers the latter for a smaller
    index, whose rows then no longer line up with x's: not offered).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard
from autopar.strategies.pointwise import broadcast_strategies, call_arg, normalize_dim

RESHAPES = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.view_copy.default",
            "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims",
            "aten.squeeze.default", "aten.unsqueeze.default", "aten.view_as.default", "aten.reshape_as.default")
IDENTITIES = ("aten.contiguous.default", "aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default")
SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.tensor_split.sections")


def summable(metas: Sequence[TensorMeta]) -> bool:
    """Whether the tensors can be Partial sums (not booleans)."""
    return all(meta.dtype != "bool" for meta in metas)


def dim_moves(dim_map: dict[int, int], inputs: Sequence[TensorMeta], partial: bool = True) -> list[Strategy1D]:
    """Strategies moving a shard from input dim k to output dim dim_map[k] (+ P -> P unless the
    op is not linear or the tensor is boolean)."""
    strategies = [Strategy1D(inputs=(shard(source),), output=shard(target), split=True, name=f"dim{target}")
                  for source, target in dim_map.items()]
    if partial and summable(inputs):
        strategies.append(Strategy1D(inputs=(PARTIAL,), output=PARTIAL, split=False, name="partial"))
    return strategies


def view_groups(from_shape: Sequence[int], to_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs (input dims, output dims) whose products match, in order (DTensor's `view_groups`).

    Size-1 dims that appear on one side only form groups with an empty other side.
    """
    groups: list[tuple[list[int], list[int]]] = []
    source = target = 0
    while source < len(from_shape) or target < len(to_shape):
        ins = [source] if source < len(from_shape) else []
        outs = [target] if target < len(to_shape) else []
        from_size = from_shape[source] if ins else 1
        to_size = to_shape[target] if outs else 1
        source, target = source + len(ins), target + len(outs)
        if from_size == 1 and to_size != 1:
            target, outs = target - len(outs), []
        elif from_size != 1 and to_size == 1:
            source, ins = source - len(ins), []
        else:
            while from_size != to_size:
                grow_input = source < len(from_shape) and (target >= len(to_shape) or to_size % from_size == 0
                                                           or to_size > from_size)
                if grow_input:
                    from_size *= from_shape[source]
                    ins.append(source)
                    source += 1
                elif target < len(to_shape):
                    to_size *= to_shape[target]
                    outs.append(target)
                    target += 1
                else:
                    break
        groups.append((ins, outs))
    return groups


def reshape_dim_map(from_shape: Sequence[int], to_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for the dims whose sharding a reshape keeps."""
    return {ins[0]: outs[0] for ins, outs in view_groups(from_shape, to_shape)
            if ins and outs and from_shape[ins[0]] > 1}


def _keep_except(rank: int, cut_dim: int | None, removed: bool = False) -> dict[int, int]:
    """Dims other than `cut_dim` keep their sharding; later dims shift down if it is removed."""
    kept = [dim for dim in range(rank) if dim != cut_dim]
    if not removed or cut_dim is None:
        return {dim: dim for dim in kept}
    return {dim: dim - 1 if dim > cut_dim else dim for dim in kept}


@register(*RESHAPES)
def reshape(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    strategies = dim_moves(reshape_dim_map(inputs[0].shape, node.output.shape), inputs)
    if len(inputs) == 2:  # view_as/reshape_as: `other` gives only its shape (= the output's)
        return [_with_shape_source(strategy) for strategy in strategies]
    return strategies


def _with_shape_source(strategy: Strategy1D) -> Strategy1D:
    other = strategy.output if strategy.output != PARTIAL else REPLICATE
    return Strategy1D(inputs=strategy.inputs + (other,), output=strategy.output, split=strategy.split,
                      name=strategy.name)


@register(*IDENTITIES)
def identity(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    return dim_moves({dim: dim for dim in range(len(inputs[0].shape))}, inputs)


@register("aten.transpose.int", "aten.swapaxes.default", "aten.t.default", "aten.permute.default",
          "aten.movedim.int", "aten.numpy_T.default")
def permute(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    order = _permutation(node, rank)
    return dim_moves({source: target for target, source in enumerate(order)}, inputs)


def _permutation(node: OpNode, rank: int) -> list[int]:
    """order[k] = the input dim that becomes output dim k."""
    order = list(range(rank))
    if node.target == "aten.permute.default":
        return [normalize_dim(dim, rank) for dim in call_arg(node, 1, "dims")]
    if node.target == "aten.movedim.int":
        source, destination = (normalize_dim(call_arg(node, i, name), rank)
                               for i, name in ((1, "source"), (2, "destination")))
        order.remove(source)
        order.insert(destination, source)
        return order
    if node.target == "aten.numpy_T.default" or (node.target == "aten.t.default" and rank == 2):
        return order[::-1]
    if node.target == "aten.t.default":  # t() of a 0-d or 1-d tensor is the tensor itself
        return order
    first, second = (normalize_dim(call_arg(node, i, f"dim{i - 1}"), rank) for i in (1, 2))
    order[first], order[second] = order[second], order[first]
    return order


@register("aten.expand.default", "aten.expand_as.default", "aten.broadcast_to.default")
def expand(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Dims that are not broadcast keep their sharding (aligned from the right)."""
    in_shape, out_shape = inputs[0].shape, node.output.shape
    offset = len(out_shape) - len(in_shape)
    dim_map = {dim: dim + offset for dim, size in enumerate(in_shape)
               if size == out_shape[dim + offset] and size > 1}
    strategies = dim_moves(dim_map, inputs)
    if len(inputs) == 2:  # expand_as(x, other): other gives only its shape
        return [_with_shape_source(strategy) for strategy in strategies]
    return strategies


@register("aten.broadcast_tensors.default")
def broadcast_tensors(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Every output has the broadcast shape and, in a Strategy1D, the same placement: so no input
    may be broadcast along the sharded dim (its expanded output would stay replicated)."""
    strategies = [strategy for strategy in broadcast_strategies(inputs, node.output.shape)
                  if REPLICATE not in strategy.inputs]
    if summable(inputs):
        strategies.append(Strategy1D(inputs=(PARTIAL,) * len(inputs), output=PARTIAL, split=False, name="partial"))
    return strategies


@register(*SPLITS)
def split(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    return dim_moves(_keep_except(rank, normalize_dim(call_arg(node, 2, "dim", 0), rank)), inputs)


@register("aten.unbind.int")
def unbind(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    dim = normalize_dim(call_arg(node, 1, "dim", 0), rank)
    return dim_moves(_keep_except(rank, dim, removed=True), inputs)


@register("getitem")
def getitem(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """One output of a multi-output op: it has the placement the producer gave every output."""
    return dim_moves({dim: dim for dim in range(len(node.output.shape))}, inputs)


@register("aten.slice.Tensor")
def slice_(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    shape = inputs[0].shape
    dim = normalize_dim(call_arg(node, 1, "dim", 0), len(shape))
    start, end, step = call_arg(node, 2, "start"), call_arg(node, 3, "end"), call_arg(node, 4, "step", 1)
    whole = start in (None, 0) and (end is None or end >= shape[dim]) and step == 1
    return dim_moves(_keep_except(len(shape), None if whole else dim), inputs)


@register("aten.narrow.default")
def narrow(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    return dim_moves(_keep_except(rank, normalize_dim(call_arg(node, 1, "dim"), rank)), inputs)


@register("aten.select.int")
def select(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    dim = normalize_dim(call_arg(node, 1, "dim"), rank)
    return dim_moves(_keep_except(rank, dim, removed=True), inputs)


@register("aten.cat.default", "aten.concat.default", "aten.concatenate.default")
def cat(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Every input in the same placement, never sharded on the cat dim."""
    ranks = {len(meta.shape) for meta in inputs}
    if len(ranks) != 1:
        return []
    rank = ranks.pop()
    dim = normalize_dim(call_arg(node, 1, "dim", 0), rank)
    return _all_inputs_alike(_keep_except(rank, dim), inputs)


@register("aten.stack.default")
def stack(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Every input in the same placement; dims at or after the new dim shift up by one."""
    rank = len(inputs[0].shape)
    dim = normalize_dim(call_arg(node, 1, "dim", 0), rank + 1)
    return _all_inputs_alike({source: source + 1 if source >= dim else source for source in range(rank)}, inputs)


def _all_inputs_alike(dim_map: dict[int, int], inputs: Sequence[TensorMeta]) -> list[Strategy1D]:
    return [Strategy1D(inputs=strategy.inputs * len(inputs), output=strategy.output, split=strategy.split,
                       name=strategy.name) for strategy in dim_moves(dim_map, inputs)]


@register("aten.repeat_interleave.self_int")
def repeat_interleave(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    rank = len(inputs[0].shape)
    dim = call_arg(node, 2, "dim")
    if dim is None:  # repeats the flattened tensor
        return []
    return dim_moves(_keep_except(rank, normalize_dim(dim, rank)), inputs, partial=False)


@register("aten.repeat.default")
def repeat(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Dims repeated once keep their sharding (repeats align from the right; extra are new dims)."""
    repeats = list(call_arg(node, 1, "repeats"))
    rank = len(inputs[0].shape)
    offset = len(repeats) - rank
    return dim_moves({dim: dim + offset for dim in range(rank) if repeats[dim + offset] == 1}, inputs)


@register("aten.gather.default")
def gather(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if len(inputs) != 2 or len(inputs[0].shape) != len(inputs[1].shape):
        return []
    source, index = inputs[0].shape, inputs[1].shape
    dim = normalize_dim(call_arg(node, 1, "dim"), len(source))
    strategies = [Strategy1D(inputs=(REPLICATE, shard(dim)), output=shard(dim), split=True, name=f"dim{dim}")]
    for other in range(len(source)):
        if other != dim and source[other] == index[other]:
            strategies.append(Strategy1D(inputs=(shard(other), shard(other)), output=shard(other), split=True,
                                         name=f"dim{other}"))
    return strategies

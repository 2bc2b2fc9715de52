"""View family: DTensor's view_groups rule, dim maps of transpose/permute/squeeze, cutting ops."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d
from autopar.strategies.views import reshape_dim_map, view_groups

X, Y = Ref(index=0), Ref(index=1)
MAX = 9223372036854775807


def _meta(spec) -> TensorMeta:
    """(4, 8) is a float32 tensor; ((4, 8), "bool") names the dtype."""
    if spec and isinstance(spec[0], tuple):
        return TensorMeta(shape=spec[0], dtype=spec[1])
    return TensorMeta(shape=tuple(spec), dtype="float32")


def _offered(target: str, args: tuple, inputs: list, outputs: list, axis_size: int = 4) -> set:
    """(input placements, output placement) pairs offered on one axis (replicate-all included)."""
    metas = [_meta(spec) for spec in inputs]
    node = OpNode(name="node", kind="call", target=target, inputs=tuple(f"in{k}" for k in range(len(metas))),
                  args=args, outputs=tuple(_meta(spec) for spec in outputs))
    return {(strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, axis_size)}


def _moves(offered: set) -> dict[str, str]:
    """Single-input strategies as {input placement: output placement}."""
    return {inputs[0]: output for inputs, output in offered}


def test_view_groups_match_dtensor() -> None:
    assert view_groups((2, 3, 4), (2, 12)) == [([0], [0]), ([1, 2], [1])]
    assert view_groups((2, 3), (3, 2)) == [([0, 1], [0, 1])]
    assert view_groups((4, 1, 8), (4, 8)) == [([0], [0]), ([1], []), ([2], [1])]
    assert reshape_dim_map((8, 6), (4, 12)) == {0: 0}


def test_splitting_heads_keeps_hidden_sharding_on_heads_when_they_divide() -> None:
    assert _moves(_offered("aten.view.default", (X, [4, 8, 4, 16]), [(4, 8, 64)], [(4, 8, 4, 16)])) == {
        "R": "R", "S0": "S0", "S1": "S1", "S2": "S2", "P": "P"}
    two_heads = _moves(_offered("aten.view.default", (X, [4, 8, 2, 32]), [(4, 8, 64)], [(4, 8, 2, 32)]))
    assert "S2" not in two_heads


def test_merging_dims_keeps_only_the_outermost_sharding() -> None:
    merged = _moves(_offered("aten.reshape.default", (X, [4, 8, 64]), [(4, 8, 4, 16)], [(4, 8, 64)]))
    assert merged["S2"] == "S2" and "S3" not in merged
    flat = _moves(_offered("aten.flatten.using_ints", (X, 0, 1), [(4, 8, 16)], [(32, 16)]))
    assert flat == {"R": "R", "S0": "S0", "S2": "S1", "P": "P"}


def test_not_divisible_shards_are_filtered() -> None:
    assert "S0" not in _moves(_offered("aten.view.default", (X, [12, 16]), [(6, 2, 16)], [(12, 16)]))


def test_transpose_and_permute_map_dims() -> None:
    swapped = _moves(_offered("aten.transpose.int", (X, 1, 2), [(4, 8, 4, 16)], [(4, 4, 8, 16)]))
    assert swapped == {"R": "R", "S0": "S0", "S1": "S2", "S2": "S1", "S3": "S3", "P": "P"}
    permuted = _moves(_offered("aten.permute.default", (X, [2, 0, 1]), [(4, 8, 16)], [(16, 4, 8)]))
    assert permuted["S2"] == "S0" and permuted["S0"] == "S1" and permuted["S1"] == "S2"
    assert _moves(_offered("aten.t.default", (X,), [(8, 16)], [(16, 8)]))["S0"] == "S1"


def test_unsqueeze_and_squeeze_shift_dims() -> None:
    assert _moves(_offered("aten.unsqueeze.default", (X, 1), [(4, 8)], [(4, 1, 8)]))["S1"] == "S2"
    assert _moves(_offered("aten.squeeze.dim", (X, 1), [(4, 1, 8)], [(4, 8)]))["S2"] == "S1"


def test_expand_never_shards_a_broadcast_dim() -> None:
    expanded = _moves(_offered("aten.expand.default", (X, [4, 4, 8, 8]), [(4, 1, 8, 8)], [(4, 4, 8, 8)]))
    assert expanded == {"R": "R", "S0": "S0", "S2": "S2", "S3": "S3", "P": "P"}
    assert _moves(_offered("aten.expand.default", (X, [4, -1]), [(8,)], [(4, 8)]))["S0"] == "S1"


def test_split_chunk_unbind_keep_only_the_uncut_dims() -> None:
    split = _moves(_offered("aten.split.Tensor", (X, 64, 2), [(4, 8, 192)], [(4, 8, 64)] * 3))
    assert split == {"R": "R", "S0": "S0", "S1": "S1", "P": "P"}
    chunk = _moves(_offered("aten.chunk.default", (X, 2, -1), [(4, 4, 8, 8)], [(4, 4, 8, 4)] * 2))
    assert "S3" not in chunk and chunk["S1"] == "S1"
    unbind = _moves(_offered("aten.unbind.int", (X, 1), [(4, 3, 8)], [(4, 8)] * 3))
    assert unbind == {"R": "R", "S0": "S0", "S2": "S1", "P": "P"}


def test_getitem_keeps_the_producers_placement() -> None:
    assert _moves(_offered("getitem", (X, 1), [(4, 8, 64)], [(4, 8, 64)])) == {
        "R": "R", "S0": "S0", "S1": "S1", "S2": "S2", "P": "P"}


def test_slice_keeps_the_sliced_dim_only_when_it_is_whole() -> None:
    whole = _moves(_offered("aten.slice.Tensor", (X, 0, 0, MAX), [(4, 16)], [(4, 16)]))
    assert whole["S0"] == "S0"
    half = _moves(_offered("aten.slice.Tensor", (X, 3, 0, 4), [(4, 4, 8, 8)], [(4, 4, 8, 4)]))
    assert "S3" not in half and half["S2"] == "S2"
    selected = _moves(_offered("aten.select.int", (X, 1, 0), [(4, 8, 16)], [(4, 16)]))
    assert selected == {"R": "R", "S0": "S0", "S2": "S1", "P": "P"}


def test_cat_and_stack_need_every_input_alike() -> None:
    cat = _offered("aten.cat.default", ([X, Y], -1), [(4, 8, 4), (4, 8, 4)], [(4, 8, 8)])
    assert cat == {(("R", "R"), "R"), (("S0", "S0"), "S0"), (("S1", "S1"), "S1"), (("P", "P"), "P")}
    stack = _offered("aten.stack.default", ([X, Y], 1), [(4, 8), (4, 8)], [(4, 2, 8)])
    assert (("S1", "S1"), "S2") in stack and (("S0", "S0"), "S0") in stack


def test_boolean_views_never_carry_partial() -> None:
    offered = _offered("aten.view.default", (X, [32]), [((4, 8), "bool")], [((32,), "bool")])
    assert not any(output == "P" for _, output in offered)


def test_repeat_interleave_keeps_the_other_dims() -> None:
    repeated = _moves(_offered("aten.repeat_interleave.self_int", (X, 2, 1), [(4, 4, 8, 8)], [(4, 8, 8, 8)]))
    assert repeated == {"R": "R", "S0": "S0", "S2": "S2", "S3": "S3"}


def _dtensor_keeps(from_shape: tuple, to_shape: tuple, axis_size: int) -> dict[int, int]:
    """Input dim -> output dim for the shards DTensor's reshape rule keeps, evenly divided."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    rule = _view_ops.view_groups(from_shape, to_shape)
    kept = {}
    for dim, size in enumerate(from_shape):
        needed, produced = _view_ops.propagate_shape_and_sharding((Shard(dim),), from_shape, rule, (axis_size,))
        output = produced[0]
        if needed[0] == Shard(dim) and type(output) is Shard and size % axis_size == 0:
            if to_shape[output.dim] % axis_size == 0:
                kept[dim] = output.dim
    return kept


@st.composite
def _reshapes(draw) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A shape and another shape with the same number of elements (size-1 dims included)."""
    from_shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 8, 12, 16]), min_size=1, max_size=4)))
    factors = [prime for size in from_shape for prime in _primes(size)]
    factors = draw(st.permutations(factors)) + [1] * draw(st.integers(0, 2))
    factors = draw(st.permutations(factors))
    cuts = sorted(draw(st.sets(st.integers(1, max(len(factors) - 1, 1)), max_size=3)))
    bounds = [0, *[cut for cut in cuts if cut < len(factors)], len(factors)]
    to_shape = tuple(math.prod(factors[start:end]) for start, end in zip(bounds, bounds[1:]) if end > start)
    return from_shape, to_shape or (1,)


def _primes(size: int) -> list[int]:
    primes, factor = [], 2
    while size > 1:
        while size % factor == 0:
            primes.append(factor)
            size //= factor
        factor += 1
    return primes


@settings(max_examples=150, deadline=None)
@given(_reshapes())
def test_reshape_keeps_exactly_the_shards_dtensor_keeps(shapes) -> None:
    from_shape, to_shape = shapes
    ours = {source: target for source, target in reshape_dim_map(from_shape, to_shape).items()
            if from_shape[source] % 4 == 0 and to_shape[target] % 4 == 0}
    assert ours == _dtensor_keeps(from_shape, to_shape, 4)

"""Pointwise family: broadcasting alignment, divisibility filtering and the Partial rules."""

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

X, Y, Z = Ref(index=0), Ref(index=1), Ref(index=2)


def _meta(spec) -> TensorMeta:
    """(4, 8) is a float32 tensor; ((4, 8), "bool") names the dtype."""
    if spec and isinstance(spec[0], tuple):
        return TensorMeta(shape=spec[0], dtype=spec[1])
    return TensorMeta(shape=tuple(spec), dtype="float32")


def _offered(target: str, args: tuple, inputs: list, outputs: list, kwargs: tuple = (), axis_size: int = 4) -> set:
    """(input placements, output placement) pairs offered on one axis (replicate-all included)."""
    metas = [_meta(spec) for spec in inputs]
    node = OpNode(name="node", kind="call", target=target, inputs=tuple(f"in{k}" for k in range(len(metas))),
                  args=args, kwargs=kwargs, outputs=tuple(_meta(spec) for spec in outputs))
    return {(strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, axis_size)}


def test_unary_shards_every_dim_that_divides_and_never_takes_partial() -> None:
    offered = _offered("aten.gelu.default", (X,), [(6, 8, 16)], [(6, 8, 16)])
    assert offered == {(("R",), "R"), (("S1",), "S1"), (("S2",), "S2")}


def test_broadcast_input_is_sharded_on_its_aligned_dim_or_replicated() -> None:
    offered = _offered("aten.add.Tensor", (X, Y), [(4, 8, 16), (16,)], [(4, 8, 16)])
    assert (("S0", "R"), "S0") in offered
    assert (("S2", "S0"), "S2") in offered
    size_one = _offered("aten.mul.Tensor", (X, Y), [(4, 8, 16), (4, 8, 1)], [(4, 8, 16)])
    assert (("S2", "R"), "S2") in size_one
    assert (("S1", "S1"), "S1") in size_one


def test_mask_aligns_from_the_right() -> None:
    offered = _offered("aten.masked_fill.Scalar", (X, Y, -1e9), [(4, 4, 8, 8), ((8, 8), "bool")], [(4, 4, 8, 8)])
    assert {(("S0", "R"), "S0"), (("S1", "R"), "S1"), (("S2", "S0"), "S2"), (("S3", "S1"), "S3")} <= offered


def test_add_and_sub_take_two_partials_but_not_a_partial_plus_a_scalar() -> None:
    assert (("P", "P"), "P") in _offered("aten.add.Tensor", (X, Y), [(4, 8), (4, 8)], [(4, 8)])
    assert (("P", "P"), "P") in _offered("aten.sub.Tensor", (X, Y), [(4, 8), (8,)], [(4, 8)])
    assert not any("P" in inputs for inputs, _ in _offered("aten.add.Tensor", (X, 1.0), [(4, 8)], [(4, 8)]))


def test_mul_is_linear_in_either_factor_and_div_in_the_numerator() -> None:
    product = _offered("aten.mul.Tensor", (X, Y), [(4, 8), (4, 8)], [(4, 8)])
    assert {(("P", "R"), "P"), (("R", "P"), "P")} <= product
    assert (("P", "P"), "P") not in product
    assert (("P",), "P") in _offered("aten.mul.Tensor", (X, 0.5), [(4, 8)], [(4, 8)])
    quotient = _offered("aten.div.Tensor", (X, Y), [(4, 8), (4, 1)], [(4, 8)])
    assert (("P", "R"), "P") in quotient and (("R", "P"), "P") not in quotient


def test_nonlinear_and_boolean_ops_never_take_partial() -> None:
    cases = [("aten.silu.default", (X,), [(4, 8)]), ("aten.dropout.default", (X, 0.1, True), [(4, 8)]),
             ("aten.clone.default", (X,), [(4, 8)]), ("aten.pow.Tensor_Scalar", (X, 2.0), [(4, 8)]),
             ("aten.where.self", (X, Y, Z), [((4, 8), "bool"), (4, 8), (4, 8)])]
    for target, args, inputs in cases:
        offered = _offered(target, args, inputs, [(4, 8)])
        assert not any("P" in inputs or output == "P" for inputs, output in offered), target
    compare = _offered("aten.mul.Tensor", (X, Y), [((4, 8), "bool"), ((4, 8), "bool")], [((4, 8), "bool")])
    assert not any(output == "P" for _, output in compare)


def test_cast_keeps_partial_only_into_floating_point() -> None:
    assert (("P",), "P") in _offered("aten.to.dtype", (X, "torch.bfloat16"), [(4, 8)], [((4, 8), "bfloat16")])
    assert (("P",), "P") not in _offered("aten.to.dtype", (X, "torch.int64"), [(4, 8)], [((4, 8), "int64")])


def test_type_as_mirrors_the_placement_onto_the_dtype_source() -> None:
    offered = _offered("aten.type_as.default", (X, Y), [(4, 8), ((4, 8), "bfloat16")], [((4, 8), "bfloat16")])
    assert {(("S0", "S0"), "S0"), (("S1", "S1"), "S1"), (("P", "P"), "P")} <= offered
    other_shape = _offered("aten.type_as.default", (X, Y), [(4, 8), ((2,), "bfloat16")], [((4, 8), "bfloat16")])
    assert (("S1", "R"), "S1") in other_shape


def test_new_factories_leave_their_input_anywhere_and_are_replicated() -> None:
    offered = _offered("aten.new_ones.default", (X, [2]), [(4, 8)], [((2,), "bool")])
    assert offered == {(("R",), "R"), (("S0",), "R"), (("S1",), "R"), (("P",), "R")}

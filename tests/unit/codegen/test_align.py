"""Plan placements reach the codegen graph's nodes by op sequence, not by name."""

from autopar.codegen.align import align_names, op_kind


def test_op_kind_drops_the_counter() -> None:
    assert op_kind("mul_12") == "mul" and op_kind("scaled_dot_product_attention") == "scaled_dot_product_attention"
    assert op_kind("view_1_2") == "view_1"


def test_identical_names_map_to_themselves() -> None:
    names = ["embedding", "mul", "linear", "mul_1"]
    assert align_names(names, names) == {name: name for name in names}


def test_a_copy_only_one_graph_has_shifts_no_placement() -> None:
    # The plan (meta) has a `contiguous` the codegen graph (CPU) lacks; the codegen graph took a
    # `mul` name for size arithmetic, so its later muls are numbered one higher.
    plan = ["transpose_3", "contiguous", "reshape_3", "linear_3", "mul_12", "to_9", "mul_13"]
    graph = ["transpose_3", "reshape_3", "linear_3", "mul_13", "to_9", "mul_14"]
    matched = align_names(plan, graph)
    assert matched == {"transpose_3": "transpose_3", "reshape_3": "reshape_3", "linear_3": "linear_3",
                       "mul_13": "mul_12", "to_9": "to_9", "mul_14": "mul_13"}

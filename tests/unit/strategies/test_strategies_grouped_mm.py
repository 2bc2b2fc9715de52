"""Grouped expert matmuls: column-, row- and expert-parallel, and exact on local shards."""

import torch

from autopar.codegen.local_ops import _grouped_mm_own_experts
from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import strategies_1d

TARGET = "transformers.grouped_mm_fallback.default"


def _offered(tokens=(12, 8), weight=(4, 8, 6), axis_size=2) -> dict:
    metas = [TensorMeta(shape=tokens, dtype="float32"), TensorMeta(shape=weight, dtype="float32"),
             TensorMeta(shape=(weight[0],), dtype="int32")]
    node = OpNode(name="gmm", kind="call", target=TARGET, inputs=("x", "w", "offs"),
                  args=(Ref(index=0), Ref(index=1), Ref(index=2)),
                  outputs=(TensorMeta(shape=(tokens[0], weight[2]), dtype="float32"),))
    return {strategy.name: (strategy.inputs, strategy.output) for strategy in strategies_1d(node, metas, axis_size)}


def test_column_row_and_expert_parallel_are_offered() -> None:
    offered = _offered()
    assert offered["col"] == (("R", "S2", "R"), "S1")
    assert offered["row"] == (("S1", "S1", "R"), "P")
    assert offered["expert"] == (("R", "S0", "R"), "P")


def test_expert_split_needs_experts_that_divide() -> None:
    assert "expert" not in _offered(weight=(3, 8, 6))


def _grouped_mm(tokens, weight, offsets):
    rows, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        rows.append(tokens[start:end] @ weight[expert])
        start = end
    return torch.cat(rows)


def test_each_devices_experts_sum_to_the_whole_op() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, weight = torch.randn(12, 8, generator=generator), torch.randn(4, 8, 6, generator=generator)
    offsets = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # expert 1 gets no tokens
    pieces = [_grouped_mm_own_experts(_grouped_mm, tokens, weight[2 * rank:2 * rank + 2], offsets, rank, (), {})
              for rank in range(2)]
    torch.testing.assert_close(pieces[0] + pieces[1], _grouped_mm(tokens, weight, offsets))

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


def test_expert_bias_is_column_parallel_and_exact_on_column_shards() -> None:
    """The per-expert bias's one rule: rows and bias split by column, offsets whole; each device's
    columns of the output and of the bias's gradient are the whole op's."""
    from autopar.models.grouped_mm import expert_bias

    metas = [TensorMeta(shape=(12, 6), dtype="float32"), TensorMeta(shape=(4, 6), dtype="float32"),
             TensorMeta(shape=(4,), dtype="int32")]
    node = OpNode(name="bias", kind="call", target="autopar.expert_bias.default", inputs=("x", "b", "offs"),
                  args=(Ref(index=0), Ref(index=1), Ref(index=2)), outputs=(metas[0],))
    offered = {s.name: (s.inputs, s.output) for s in strategies_1d(node, metas, 2)}
    assert offered["col"] == (("S1", "S1", "R"), "S1") and set(offered) == {"col", "replicate"}
    generator = torch.Generator().manual_seed(0)
    rows, bias = torch.randn(12, 6, generator=generator), torch.randn(4, 6, generator=generator, requires_grad=True)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 gets none; rows 10, 11 are padding
    whole = expert_bias(rows, bias, offsets)
    grad = torch.randn(whole.shape, generator=generator)
    (whole_grad,) = torch.autograd.grad(whole, bias, grad)
    for columns in (slice(0, 3), slice(3, 6)):
        piece_bias = bias.detach()[:, columns].clone().requires_grad_()
        piece = expert_bias(rows[:, columns], piece_bias, offsets)
        torch.testing.assert_close(piece, whole[:, columns])
        (piece_grad,) = torch.autograd.grad(piece, piece_bias, grad[:, columns])
        torch.testing.assert_close(piece_grad, whole_grad[:, columns])
    torch.testing.assert_close(whole[10:], rows[10:])

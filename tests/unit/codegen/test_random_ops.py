"""Which calls draw random numbers (codegen/random_ops.py); the cross-rank draws are in
tests/dist/test_random_ops_runs.py."""

import torch

from autopar.codegen.random_ops import draws, random_nodes

aten = torch.ops.aten


def test_dropout_draws_only_with_p_above_zero_in_training():
    x = torch.ones(2)
    assert draws(aten.dropout.default, (x, 0.1, True), {})
    assert not draws(aten.dropout.default, (x, 0.0, True), {})
    assert not draws(aten.dropout.default, (x, 0.1, False), {})
    assert draws(aten.native_dropout.default, (x, 0.5, None), {})


def test_attention_draws_only_with_dropout():
    q = torch.ones(1, 1, 2, 2)
    assert not draws(aten.scaled_dot_product_attention.default, (q, q, q), {})
    assert draws(aten.scaled_dot_product_attention.default, (q, q, q), {"dropout_p": 0.1})


def test_random_fills_and_like_ops_draw_and_others_do_not():
    x = torch.ones(2)
    for target in (aten.exponential_.default, aten.uniform_.default, aten.rand_like.default,
                   aten.bernoulli.default, aten.randn.default):
        assert draws(target, (x,), {}), target
    for target in (aten.empty_like.default, aten.add.Tensor, torch.add):
        assert not draws(target, (x,), {}), target


class _Noisy(torch.nn.Module):
    def forward(self, x):
        gumbel = torch.empty_like(x).exponential_().log()
        return torch.nn.functional.dropout(x - gumbel, 0.2) + torch.nn.functional.dropout(x, 0.0)


def test_random_nodes_of_an_exported_model():
    program = torch.export.export(_Noisy(), (torch.ones(2, 3),))
    found = random_nodes(program.graph)
    targets = {str(node.target) for node in program.graph.nodes if node.name in found}
    assert targets == {"aten.exponential_.default", "aten.dropout.default"}
    assert len(found) == 2  # the dropout with p = 0 draws nothing

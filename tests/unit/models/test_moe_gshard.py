"""The GShard expert layer (`moe:router=gshard`): routing against a token-by-token reference, capacity."""

import pytest
import torch

from autopar.models import build_model
from autopar.models.moe_gshard import GShardFeedForward, GShardShape

TINY = dict(hidden=64, num_experts=4, top_k=2, ffn_hidden=256, capacity_factor=1.25, dropout=0.0)



def naive_moe(layer: GShardFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token top-k routing without capacity, the definition the layer must match."""
    gates = layer.router(x).softmax(dim=-1)
    top_gates, top_experts = gates.topk(layer.config.top_k, dim=-1)
    if layer.config.top_k > 1:
        top_gates = top_gates / top_gates.sum(dim=-1, keepdim=True)
    output = torch.zeros_like(x)
    for position in torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(x.shape[1])).tolist():
        token = x[tuple(position)]
        for gate, expert in zip(top_gates[tuple(position)], top_experts[tuple(position)].tolist()):
            expert_out = torch.nn.functional.gelu(token @ layer.w_in[expert]) @ layer.w_out[expert]
            output[tuple(position)] += gate * expert_out
    return output


def moe_layer(**overrides) -> GShardFeedForward:
    torch.manual_seed(0)
    return GShardFeedForward(GShardShape(**{**TINY, **overrides}))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_matches_token_by_token_routing_when_nothing_is_dropped(top_k):
    layer = moe_layer(top_k=top_k, capacity_factor=4.0 / top_k)  # capacity = seq: no expert can overflow
    x = torch.randn(2, 32, 64)
    torch.testing.assert_close(layer(x), naive_moe(layer, x))
    _, dispatch = layer.route(x)
    assert torch.equal(dispatch.sum(dim=(-2, -1)), torch.full((2, 32), float(top_k)))  # every token to k experts


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_output_depends_on_the_router(top_k):
    layer = moe_layer(top_k=top_k)
    x = torch.randn(2, 32, 64)
    before = layer(x)
    before.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        layer.router.weight.mul_(-1.0)
    assert not torch.allclose(layer(x), before)


def test_moe_drops_tokens_past_capacity():
    layer = moe_layer(capacity_factor=0.1)
    capacity = layer.config.expert_capacity(32)
    assert capacity == 2  # ceil(0.1 * 32 * 2 / 4)
    x = torch.randn(2, 32, 64)
    combine, dispatch = layer.route(x)
    assert dispatch.shape == combine.shape == (2, 32, 4, capacity)
    assert dispatch.sum(dim=1).max() <= 1  # each slot holds at most one token
    dropped = layer(x).abs().sum(dim=-1) == 0
    assert dropped.any() and not dropped.all()


def test_moe_experts_are_stacked_on_the_leading_dim():
    model = build_model("moe:router=gshard,num_experts=8,hidden=32,heads=2,expert_ffn_hidden=48").model
    mlp = model.layers[0].mlp
    assert mlp.w_in.shape == (8, 32, 48) and mlp.w_out.shape == (8, 48, 32)
    assert mlp.router.weight.shape == (8, 32) and mlp.router.bias is None

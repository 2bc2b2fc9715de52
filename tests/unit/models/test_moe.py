"""The `moe` family: routers and the expert layer against per-token loops, shared experts, capacity,
latent attention shapes, spec errors, named sizes' parameter counts, and capture (expert ops, block reuse)."""

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from autopar import api
from autopar.capture.block_reuse import capture_reusing_blocks
from autopar.errors import ModelSpecError
from autopar.models import build_model, resolve_spec
from autopar.models.moe import MoEConfig
from autopar.models.moe_layer import MoELayer
from autopar.plans import planning
from autopar.solver.experts import find_expert_ops

MLA = dict(attention="mla", q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def layer(**overrides) -> MoELayer:
    torch.manual_seed(0)
    moe = MoELayer(MoEConfig(**overrides))
    if overrides.get("router") == "sigmoid":
        with torch.no_grad():
            moe.router.expert_bias.copy_(torch.randn(moe.num_experts))  # the choice must use it
    return moe


def naive_route(moe: MoELayer, token: torch.Tensor) -> list[tuple[float, int]]:
    """(gate, expert) of one token, from the routers' definitions."""
    logits = moe.router.gate(token).float()
    if moe.router.kind == "sigmoid":
        scores = logits.sigmoid()
        chosen = sorted(range(moe.num_experts), key=lambda e: -(scores[e] + moe.router.expert_bias[e]).item())
        chosen = chosen[:moe.top_k]
    else:
        scores = logits.softmax(dim=-1)
        chosen = sorted(range(moe.num_experts), key=lambda e: -scores[e].item())[:moe.top_k]
    total = sum(scores[e] for e in chosen)
    return [(scores[e] / total, e) for e in chosen]


def swiglu_expert(moe: MoELayer, token: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert on one token; with GPT-OSS's keys as transformers' GptOssExperts computes it
    (gate_up_proj_bias[e], _apply_gate with swiglu_alpha 1.702, down_proj_bias[e])."""
    experts = moe.experts
    gate_up = token @ experts.w_gate_up[expert]
    if experts.b_gate_up is not None:
        gate_up = gate_up + experts.b_gate_up[expert]
    gate, up = gate_up[0::2], gate_up[1::2]  # interleaved columns, as GptOssExperts reads them
    if experts.swiglu_limit:
        limit = experts.swiglu_limit
        gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    else:
        hidden = F.silu(gate) * up
    out = hidden @ experts.w_down[expert]
    return out + experts.b_down[expert] if experts.b_down is not None else out


def naive_layer(moe: MoELayer, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token, expert by expert; with `capacity`, an expert takes its first `capacity`
    (choice, token) pairs, every first choice before any second one."""
    tokens = x.flatten(0, -2)
    routes = [naive_route(moe, token) for token in tokens]
    taken = [0] * moe.num_experts
    kept = set()
    for choice in range(moe.top_k):
        for index, route in enumerate(routes):
            expert = route[choice][1]
            if capacity is None or taken[expert] < capacity:
                kept.add((index, choice))
            taken[expert] += 1
    output = torch.zeros_like(tokens)
    for index, (token, route) in enumerate(zip(tokens, routes)):
        for choice, (gate, expert) in enumerate(route):
            if (index, choice) in kept:
                output[index] += gate * swiglu_expert(moe, token, expert)
        if moe.shared is not None:
            output[index] += moe.shared(token)
    return output.view_as(x)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_router_matches_its_definition_token_by_token(router, top_k):
    moe = layer(router=router, top_k=top_k)
    tokens = torch.randn(20, 64)
    gates, choices = moe.router(tokens)
    for token, token_gates, token_choices in zip(tokens, gates, choices):
        expected = naive_route(moe, token)
        assert token_choices.tolist() == [expert for _, expert in expected]
        torch.testing.assert_close(token_gates, torch.stack([gate for gate, _ in expected]))
    torch.testing.assert_close(gates.sum(dim=-1), torch.ones(20))


def test_the_sigmoid_bias_chooses_but_does_not_weigh():
    moe = layer(router="sigmoid", top_k=1)
    tokens = torch.randn(8, 64)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
    gates, choices = moe.router(tokens)
    assert (choices == 0).all() and torch.equal(gates, torch.ones(8, 1))
    assert not moe.router.expert_bias.requires_grad


@pytest.mark.parametrize("overrides", [dict(top_k=1), dict(top_k=2), dict(top_k=4, num_experts=4),
                                       dict(router="sigmoid", shared_experts=2)],
                         ids=["top1", "top2", "all-experts", "sigmoid-shared"])
def test_dropless_layer_equals_a_loop_over_tokens_and_experts(overrides):
    moe = layer(**overrides)
    x = torch.randn(2, 9, 64)
    torch.testing.assert_close(moe(x), naive_layer(moe, x), rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_equal_a_loop_with_biases_and_the_clamped_glu():
    moe = layer(expert_bias=True, swiglu_limit=0.05)  # a limit the tiny init's activations cross
    with torch.no_grad():
        moe.experts.b_gate_up.copy_(torch.randn_like(moe.experts.b_gate_up) * 0.1)
        moe.experts.b_down.copy_(torch.randn_like(moe.experts.b_down))
    x = torch.randn(2, 9, 64)
    torch.testing.assert_close(moe(x), naive_layer(moe, x), rtol=1e-5, atol=1e-5)
    moe(x).square().sum().backward()
    assert moe.experts.b_gate_up.grad.abs().sum() > 0 and moe.experts.b_down.grad.abs().sum() > 0


def _banded_attention(attention, x, cos, sin):
    """`attention` over the whole sequence with transformers' sliding-window causal mask."""
    from autopar.models.llama import apply_rotary
    from autopar.models.moe import in_window

    query = apply_rotary(attention._split_heads(attention.q_proj(x), attention.num_heads), cos, sin)
    key = apply_rotary(attention._split_heads(attention.k_proj(x), attention.num_kv_heads), cos, sin)
    value = attention._split_heads(attention.v_proj(x), attention.num_kv_heads)
    positions = torch.arange(x.shape[-2])
    context = F.scaled_dot_product_attention(query, key, value, enable_gqa=True,
                                             attn_mask=in_window(positions.unsqueeze(-1) - positions, attention.window))
    return attention.o_proj(context.transpose(1, 2).flatten(-2))


def test_sliding_window_alternates_and_a_window_past_the_sequence_is_causal():
    from autopar.models.llama import GroupedQueryAttention
    from autopar.models.moe import WindowedAttention

    model = build_model("moe:layers=4,sliding_window=4").model
    assert [type(block.attn) for block in model.layers] == [WindowedAttention, GroupedQueryAttention] * 2
    assert [block.attn.window for block in model.layers[::2]] == [4, 4]
    torch.manual_seed(0)
    config = MoEConfig(sliding_window=64)
    windowed, causal = WindowedAttention(config, 64), GroupedQueryAttention(config)
    causal.load_state_dict(windowed.state_dict())
    x, cos, sin = torch.randn(2, 8, 64), torch.ones(8, 16), torch.zeros(8, 16)
    torch.testing.assert_close(windowed(x, cos, sin), causal(x, cos, sin), rtol=1e-5, atol=1e-5)
    blocked = WindowedAttention(config, 2)  # 8 % 2 == 0: query blocks of 2 over keys of 2 blocks
    blocked.load_state_dict(windowed.state_dict())
    torch.testing.assert_close(blocked(x, cos, sin), _banded_attention(blocked, x, cos, sin), rtol=1e-5, atol=1e-5)
    narrow = WindowedAttention(config, 1)  # each position sees itself only: o_proj(v_proj(x)), per head
    narrow.load_state_dict(windowed.state_dict())
    value = narrow.v_proj(x).unflatten(-1, (2, 16)).repeat_interleave(2, dim=-2).flatten(-2)
    torch.testing.assert_close(narrow(x, cos, sin), narrow.o_proj(value), rtol=1e-5, atol=1e-5)


def test_gradients_reach_router_experts_and_shared_experts():
    moe = layer(shared_experts=1)
    moe(torch.randn(2, 9, 64)).square().sum().backward()
    for parameter in (moe.router.gate.weight, moe.experts.w_gate_up, moe.experts.w_down, moe.shared.up_proj.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_shared_experts_are_one_swiglu_always_applied():
    moe = layer(shared_experts=3, expert_ffn_hidden=16)
    assert moe.shared.gate_proj.weight.shape == (48, 64)  # 3 experts of width 16
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        moe.experts.w_down.zero_()  # routed experts silent: the shared experts remain
    torch.testing.assert_close(moe(x), moe.shared(x))


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0])
def test_capacity_drops_the_pairs_past_it_in_choice_then_token_order(capacity_factor):
    moe = layer(capacity_factor=capacity_factor)
    x = torch.randn(2, 9, 64)
    rows = 2 * 9 * moe.top_k
    capacity = math.ceil(capacity_factor * rows / moe.num_experts)
    torch.testing.assert_close(moe(x), naive_layer(moe, x, capacity), rtol=1e-5, atol=1e-5)


def test_a_large_capacity_drops_nothing():
    moe = layer(capacity_factor=4.0)
    x = torch.randn(2, 9, 64)
    torch.testing.assert_close(moe(x), naive_layer(moe, x), rtol=1e-5, atol=1e-5)


def test_experts_are_stacked_parameters():
    model = build_model("moe:num_experts=8,hidden=32,heads=2,kv_heads=1,expert_ffn_hidden=48").model
    experts = model.layers[0].mlp.experts
    assert experts.w_gate_up.shape == (8, 32, 96) and experts.w_down.shape == (8, 48, 32)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_latent_attention_shapes(q_lora_rank):
    bundle = build_model("moe:" + ",".join(f"{k}={v}" for k, v in {**MLA, "q_lora_rank": q_lora_rank}.items()),
                         device="cpu", seed=0)
    attention = bundle.model.layers[0].attn
    shapes = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    query = {"q_proj.weight": (4 * 12, 64)} if q_lora_rank == 0 else {
        "q_a_proj.weight": (12, 64), "q_a_norm.weight": (12,), "q_b_proj.weight": (4 * 12, 12)}
    assert shapes == {**query, "kv_a_proj.weight": (16 + 4, 64), "kv_a_norm.weight": (16,),
                      "kv_b_proj.weight": (4 * (8 + 6), 16), "o_proj.weight": (64, 4 * 6)}
    assert bundle.config.head_dim == 12 and bundle.model.rotary.cos.shape == (32, 4)
    assert bundle.model(*bundle.example_inputs).shape == (2, 32, 128)


def test_dense_layers_lead():
    model = build_model("moe:layers=3,dense_layers=1,ffn_hidden=96").model
    assert type(model.layers[0].mlp).__name__ == "SwiGLU" and model.layers[0].mlp.up_proj.out_features == 96
    assert all(isinstance(block.mlp, MoELayer) for block in model.layers[1:])


@pytest.mark.parametrize(("spec", "words"), [
    ("moe:top_k=5,num_experts=4", ["top_k (5) must be at most num_experts (4)"]),
    ("moe:attention=mla", ["attention=mla needs kv_lora_rank > 0", "set kv_lora_rank"]),
    ("moe:router=topk", ["'router' expects one of 'softmax', 'sigmoid', 'gshard'", "got 'topk'"]),
    ("moe:attention=mqa", ["'attention' expects one of 'gqa', 'mla'"]),
    ("moe:layers=2,dense_layers=2", ["dense_layers (2) must be less than layers (2)"]),
    ("moe:capacity_factor=-0.5", ["'capacity_factor' must be >= 0"]),
    ("moe:dropout=0.1", ["dropout=0.1 applies to router=gshard only"]),
    ("moe:router=gshard,attention=mla,kv_lora_rank=8,qk_nope_head_dim=8,qk_rope_head_dim=4,v_head_dim=8",
     ["router=gshard builds the 2020 GShard GPT, which has no attention=mla"]),
    ("moe:router=gshard,capacity_factor=0", ["no capacity_factor=0"]),
    ("moe:heads=4,kv_heads=3", ["heads (4) must be divisible by kv_heads (3)"]),
    ("moe:head_dim=7", ["head_dim (7) must be even"]),
    ("moe:shared_experts=-1", ["'shared_experts' must be >= 0"]),
    ("moe:sliding_window=-1", ["'sliding_window' must be >= 0"]),
    ("moe:router=gshard,expert_bias=true", ["no expert_bias"]),
    ("moe:sliding_window=8,attention=mla,kv_lora_rank=8,qk_nope_head_dim=8,qk_rope_head_dim=4,v_head_dim=8",
     ["sliding_window applies to attention=gqa only"]),
])
def test_spec_errors_say_what_to_change(spec, words):
    with pytest.raises(ModelSpecError) as error:
        resolve_spec(spec)
    for word in words:
        assert word in str(error.value)


PUBLISHED_TOTALS = {  # total parameters as their authors publish them
    "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9,
    "deepseek-v3": 671e9, "gpt-oss-120b": 116.8e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_named_sizes_have_their_published_parameter_count(name):
    model = build_model(name).model
    total = sum(parameter.numel() for parameter in model.parameters())
    assert total == pytest.approx(PUBLISHED_TOTALS[name], rel=0.02)


def test_deepseek_v3_shape():
    config = resolve_spec("deepseek-v3").config
    assert (config.layers, config.dense_layers, config.num_experts, config.top_k, config.shared_experts) == \
        (61, 3, 256, 8, 1)
    assert (config.router, config.attention, config.capacity_factor) == ("sigmoid", "mla", 0.0)


TINY_CAPTURE = "moe:layers=5,dense_layers=1,shared_experts=1,router=sigmoid," + ",".join(
    f"{k}={v}" for k, v in MLA.items())


def test_capture_finds_the_grouped_expert_matmuls_and_reuses_blocks():
    used = []

    def strict(*args, **kwargs):
        graph = capture_reusing_blocks(*args, **kwargs, strict=True)
        used.append(graph is not None)
        return graph

    with mock.patch.object(planning, "capture_reusing_blocks", strict):
        graph = api.capture_for_planning(TINY_CAPTURE)
    assert used == [True]
    assert graph == api.capture_for_planning(TINY_CAPTURE, reuse_blocks=False)
    ops = find_expert_ops(graph)
    params = {graph[op.param].target for op in ops}
    assert params == {f"layers.{i}.mlp.experts.{name}" for i in range(1, 5) for name in ("w_gate_up", "w_down")}
    assert {op.kind for op in ops} == {"grouped_mm"} and all(op.dropless and op.num_experts == 4 for op in ops)
    assert sorted(block.num_instances for block in graph.blocks) == [1, 4]

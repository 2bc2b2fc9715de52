"""Recomputation by module (solver/recompute_modules.py): the module kinds found on the graph of
tiny built-in models and of an eager-attention module, what "modules:<kinds>" keeps, how it is
priced against the other modes, and the mode's checks."""

import pytest
import torch
from torch import nn

import autopar
from autopar import evaluate
from autopar.errors import ConfigError
from autopar.models import build_model
from autopar.solver.recompute_modules import (MODULE_KINDS, check_recompute, classify, lighter_modes,
                                              modules_mode)

TINY_MOE = "moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4"
TINY_MLA = ("moe:attention=mla,q_lora_rank=16,kv_lora_rank=16,qk_nope_head_dim=8,qk_rope_head_dim=4,v_head_dim=8,"
            "layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4")
TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,seq=32,vocab=128"


def _graph(spec: str):
    bundle = build_model(spec, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_targets=bundle.example_targets)


@pytest.fixture(scope="module")
def moe_graph():
    return _graph(TINY_MOE)


@pytest.fixture(scope="module")
def llama_graph():
    return _graph(TINY_LLAMA)


def _targets(graph, names) -> set[str]:
    return {graph[name].target for name in names}


def _param_names(graph, names) -> set[str]:
    return {graph[source].target.rsplit(".", 2)[-2] for name in names for source in graph[name].inputs
            if graph[source].kind == "param"}


def test_the_tiny_moe_has_norms_attention_expert_activations_and_moe(moe_graph):
    classification = classify(moe_graph)
    assert {"layernorm", "core_attn", "moe_act", "moe"} <= classification.found
    assert "mlp" not in classification.found and "mla_up_proj" not in classification.found
    block = classification.segments["layers.0"]
    assert _targets(moe_graph, block.kinds["layernorm"]) == {"aten.rms_norm.default"}
    assert len(block.kinds["layernorm"]) == 2  # the attention and MLP norms
    assert _targets(moe_graph, block.kinds["core_attn"]) == {"aten.scaled_dot_product_attention.default"}
    # silu(gate) * up between the two grouped matmuls, nothing else
    assert "aten.silu.default" in _targets(moe_graph, block.kinds["moe_act"])
    assert not any("grouped_mm" in target for target in _targets(moe_graph, block.kinds["moe_act"]))
    # the MoE module: router (top-k), permutation, both expert matmuls, combine
    moe_targets = _targets(moe_graph, block.kinds["moe"])
    assert {"aten.topk.default", "grouped_mm.default"} <= moe_targets
    assert block.kinds["moe_act"] <= block.kinds["moe"]
    assert not block.kinds["moe"] & (block.kinds["core_attn"] | block.kinds["layernorm"])


def test_mla_up_projections_read_the_norms_over_the_latents():
    graph = _graph(TINY_MLA)
    block = classify(graph).segments["layers.0"]
    assert _param_names(graph, block.kinds["mla_up_proj"]) == {"q_b_proj", "kv_b_proj"}
    # the latents' norms are norms too
    assert len(block.kinds["layernorm"]) == 4
    # with the up-projections, the RoPE and concatenations that make the attention's q and k: as
    # Megatron-Core's checkpointed qkv_up_proj_and_rope_apply, their outputs (which the attention
    # saves) are dropped after the forward and made again before the attention's backward
    up = block.kinds["mla_up_proj"]
    assert "aten.cat.default" in _targets(graph, up) and not up & block.kinds["core_attn"]
    kinds = ("mla_up_proj",)
    freed = {graph[name].target for name in block.freed(kinds)}
    assert "aten.cat.default" in freed
    assert not up & block.kept(kinds)


def test_the_tiny_llama_has_norms_attention_and_a_dense_mlp(llama_graph):
    classification = classify(llama_graph)
    assert classification.found == {"layernorm", "core_attn", "mlp"}
    block = classification.segments["layers.0"]
    assert _param_names(llama_graph, block.kinds["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert "aten.silu.default" in _targets(llama_graph, block.kinds["mlp"])
    with pytest.raises(ConfigError, match="moe_act.*not found.*expert matmuls"):
        classification.check(("layernorm", "moe_act"))
    assert classification.candidate_modes() == ["modules:layernorm,core_attn"]


class EagerAttention(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / 4.0
        return x + self.out(torch.softmax(scores, dim=-1) @ v)


class EagerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EagerAttention() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_eager_attention_core_is_the_scores_softmax_and_value_matmul():
    graph = autopar.capture_for_planning(EagerModel(), (torch.randn(2, 8, 16),))
    classification = classify(graph)
    block = classification.segments["blocks.0"]
    core = _targets(graph, block.kinds["core_attn"])
    assert "aten.softmax.int" in core or "aten._softmax.default" in core
    assert sum(1 for name in block.kinds["core_attn"] if graph[name].target in ("aten.matmul.default",
                                                                               "aten.bmm.default")) >= 2
    assert not _param_names(graph, block.kinds["core_attn"])  # no projection
    assert "aten.layer_norm.default" in _targets(graph, block.kinds["layernorm"])
    assert "mlp" not in classification.found  # two weight matmuls, but around attention


def test_regions_recompute_the_chosen_kinds_and_keep_the_rest(moe_graph):
    block = classify(moe_graph).segments["layers.0"]
    kinds = ("layernorm", "moe_act")
    chosen = block.chosen(kinds)
    regions = block.regions(kinds)
    inside = {name for region in regions for name in region}
    assert chosen <= inside and chosen <= block.recomputed(kinds)
    assert not block.kept(kinds) & chosen
    # the norms' outputs and silu(gate) * up, saved by their readers, are dropped
    assert {moe_graph[name].target for name in block.freed(kinds)} == {"aten.rms_norm.default", "aten.mul.Tensor"}
    # only matmuls' outputs are kept beyond what "none" keeps; no matmul runs twice
    assert all(name in block.matmuls for name in block.added(kinds))
    assert not block.recomputed(kinds) & block.matmuls
    # each region is contiguous, in forward order; the gate_up matmul feeds moe_act and is kept, not
    # recomputed (the MLP norm's region reaches the gates' cast, type_as(tokens), so it spans the routing)
    for region in regions:
        start = block.order.index(region[0])
        assert region == block.order[start:start + len(region)]
    gate_up = next(iter(block.input_roots["moe_act"]))
    assert moe_graph[gate_up].target == "grouped_mm.default"
    assert gate_up not in block.recomputed(kinds) and gate_up in block.matmuls


def test_the_mode_string_is_checked_and_canonical():
    assert modules_mode("moe_act, layernorm") == "modules:layernorm,moe_act"
    assert check_recompute("modules:core_attn,layernorm") == "modules:layernorm,core_attn"
    assert check_recompute("op") == "op"
    for bad in ("modules:", "modules:attention", "partial", ""):
        with pytest.raises(ConfigError) as error:
            check_recompute(bad)
        assert all(kind in str(error.value) for kind in MODULE_KINDS)
    assert lighter_modes("modules:layernorm") == ("none", "gathers")
    assert lighter_modes("op") == ("none", "gathers", "selective")


def _stage(plan):
    return plan.stages[0].memory_bytes["activations"], plan.predicted.step_time_s


@pytest.mark.parametrize("spec, kinds", [(TINY_MOE, "layernorm,moe_act"), (TINY_LLAMA, "layernorm,core_attn")])
def test_modules_price_between_none_and_full(spec, kinds):
    priced = {mode: _stage(evaluate(spec, cluster="dgx-h100:nodes=1", global_batch=16, tp=1, pp=1, dp=8,
                                    microbatch_size=2, recompute=mode))
              for mode in ("none", f"modules:{kinds}", "full")}
    (none_bytes, none_s), (modules_bytes, modules_s), (full_bytes, full_s) = priced.values()
    assert full_bytes < modules_bytes < none_bytes
    assert none_s < modules_s <= full_s


def test_a_kind_the_model_lacks_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="moe_act.*not found"):
        evaluate(TINY_LLAMA, cluster="dgx-h100:nodes=1", global_batch=16, tp=1, pp=1, dp=8, microbatch_size=2,
                 recompute="modules:moe_act")


def test_the_search_tries_the_candidate_sets_the_model_holds(moe_graph):
    assert classify(moe_graph).candidate_modes() == ["modules:layernorm,moe_act", "modules:layernorm,core_attn"]
    plan = autopar.plan(TINY_MOE, cluster="dgx-h100:nodes=1", global_batch=16,
                        constraints={"tp": 1, "pp": 1, "recompute_modules": "moe_act,layernorm"})
    assert plan.recompute == "modules:layernorm,moe_act"
    assert "modules:layernorm,moe_act" in plan.summary()

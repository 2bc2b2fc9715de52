"""MoE parallel folding (etp = 1 with tp > 1): the token-local region of each MoE layer, its fixed
strategies, the ep group over tp x dp, the checks of etp, and that `plan` searches it where the
runtime runs it (cp = 1, not Megatron-style module recomputation) while `evaluate` prices the rest
and says so."""

import pytest

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.models import build_model
from autopar.solver.configs import ParallelConfig
from autopar.solver.context_parallel import sequence_length
from autopar.solver.expert_folding import (TOKEN_LOCAL, etp_blocker, fixed_token_local, read_outside, runs_folded,
                                           runtime_blocker, token_local_region)
from autopar.solver.experts import find_expert_ops
from autopar.solver.search import Planner
from autopar.cluster import Cluster
from autopar.plans.plan import Plan
from autopar.report.explain import explain_text

MOE = "moe:layers=2,hidden=64,heads=4,kv_heads=2,seq=32,vocab=128,num_experts=8,top_k=2,expert_ffn_hidden=64"
CLUSTER = "dgx-h100:nodes=2"


@pytest.fixture(scope="module")
def graph():
    bundle = build_model(MOE, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_targets=bundle.example_targets)


def test_the_region_holds_router_sort_experts_and_unsort(graph) -> None:
    ops = find_expert_ops(graph)
    region = token_local_region(graph, ops)
    targets = {graph[name].target for name in region}
    assert {op.node for op in ops} <= set(region)
    assert {"aten.topk.default", "aten.argsort.stable", "aten.linear.default"} <= targets
    assert "aten.scaled_dot_product_attention.default" not in targets  # attention stays on the tp solve


def test_each_layer_hands_out_its_exit_only(graph) -> None:
    ops = find_expert_ops(graph)
    region = token_local_region(graph, ops)
    exits = read_outside(graph, region)
    assert len(exits) == 2 and all(graph[name].target == "aten.view_as.default" for name in exits)  # 2 layers
    assert runs_folded(graph, ops, region)
    assert not runs_folded(graph, ops, region[:-1])  # the last layer cut short: its sum and norm read outside


def test_region_ops_split_tokens_and_keep_experts_whole(graph) -> None:
    ops = find_expert_ops(graph)
    fixed = fixed_token_local(graph, token_local_region(graph, ops), ops, sequence_length(graph))
    for op in ops:
        strategy = fixed[op.node]
        assert strategy.name == TOKEN_LOCAL
        assert strategy.inputs[op.token_input] == ("S0",) and strategy.inputs[op.weight_input] == ("R",)
        assert strategy.input_grad(op.weight_input, 0, True) == "R"  # reduced in the expert group, not on tp


def test_etp_rule() -> None:
    assert etp_blocker(2, 8, None) == etp_blocker(2, 8, 2) == etp_blocker(2, 8, 1) == ""
    assert "must divide tp=4" in etp_blocker(4, 2, 3)
    assert "not a degree between" in etp_blocker(4, 2, 2)
    assert "needs ep > 1" in etp_blocker(2, 1, 1)


def test_the_folded_ep_group_lies_inside_a_node(graph) -> None:
    planner = Planner(graph, Cluster.from_spec(CLUSTER), global_batch=16)
    base = dict(dp=8, tp=2, pp=1, microbatch_size=1, num_microbatches=2, ep=8)
    across = planner.step_model.ep_group(ParallelConfig(**base))
    inside = planner.step_model.ep_group(ParallelConfig(**base, etp=1))
    assert (across.num_nodes, inside.num_nodes, inside.devices_per_node) == (2, 1, 8)
    folded = ParallelConfig(**base, etp=1)
    assert folded.folds_experts and folded.expert_data_shards == 2
    assert planner.step_model.expert_replica_group(folded).num_nodes == 2  # ranks 0 and 8 hold the same experts


def _evaluate(graph, **config):
    return autopar.evaluate(graph, cluster=CLUSTER, global_batch=16, tp=2, microbatch_size=1, zero_stage=1, **config)


def test_evaluate_prices_folding_and_says_it_does_not_run(graph) -> None:
    # The tp solve never splits the experts by expert on tp (ep's split): etp = tp prices with ep too.
    plain = _evaluate(graph, ep=8)
    assert plain.ep == 8 and plain.etp in (None, 2) and plain.predicted.breakdown_s["ep.dispatch"] > 0
    folded = _evaluate(graph, ep=8, etp=1)
    assert not any("runs MoE parallel folding" in note for note in folded.notes)  # pp = 1: the runtime runs it
    assert not any("runs MoE parallel folding" in note for note in _evaluate(graph, ep=8, etp=1, pp=2, dp=4).notes)
    modules = _evaluate(graph, ep=8, etp=1, recompute="modules:layernorm,moe_act")
    assert runtime_blocker(1, "modules:layernorm,moe_act") in modules.notes
    assert folded.predicted.breakdown_s["ep.dispatch"] > 0
    assert (folded.ep, folded.etp) == (8, 1)
    assert "ep=8 etp=1" in explain_text(folded)
    assert "etp=1: split over ep=8 of the tp x dp ranks" in folded.summary()
    assert Plan.from_dict(folded.to_dict()).etp == 1


@pytest.mark.parametrize("config, message", [
    (dict(ep=8, etp=3), "etp=3 must divide tp=2"),
    (dict(ep=1, etp=1), "needs ep > 1"),
    (dict(ep=8, etp=1, sequence_parallel=False), "needs sequence parallelism"),
    (dict(ep=16, etp=1, dp=4, pp=2), "ep must divide tp x dp"),
])
def test_evaluate_refuses_bad_etp(graph, config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _evaluate(graph, **config)


def test_runtime_rule() -> None:
    assert runtime_blocker(1, "none") == runtime_blocker(1, "full") == runtime_blocker(1, "selective") == ""
    assert "not cp=2, recompute='modules:moe_act'" in runtime_blocker(2, "modules:moe_act")


def test_plan_searches_folding_where_it_runs_and_pins_tp_otherwise(graph) -> None:
    plan = autopar.plan(graph, cluster=CLUSTER, global_batch=16, constraints={"etp": 1, "tp": 2, "ep": 8})
    assert (plan.mesh["tp"], plan.ep, plan.etp) == (2, 8, 1)
    with pytest.raises(InfeasiblePlanError, match="etp=1: autopar's runtime runs MoE parallel folding"):
        autopar.plan(graph, cluster=CLUSTER, global_batch=16,
                     constraints={"etp": 1, "tp": 2, "ep": 8, "recompute": "modules:moe_act"})
    plan = autopar.plan(graph, cluster=CLUSTER, global_batch=16, constraints={"etp": 2, "pp": 1})
    assert plan.mesh["tp"] == 2 and plan.etp is None


def test_gpt_oss_unchained_expert_matmuls_form_one_layer_region() -> None:
    """GPT-OSS adds a bias gathered per row between its grouped matmuls (not chained): the layer
    is still one token-local region from the norm to the weighted sum, and folding prices it."""
    transformers = pytest.importorskip("transformers")
    from hf_meta import capture_causal_lm

    config = transformers.GptOssConfig(use_cache=False, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                       max_position_embeddings=32)
    oss = capture_causal_lm(transformers.GptOssForCausalLM, config)
    ops = find_expert_ops(oss)
    assert ops and not any(op.chain_to for op in ops)
    region = set(token_local_region(oss, ops))
    assert {op.node for op in ops} <= region
    assert any(oss[name].target == "aten.clamp.default" for name in region)  # the activation between them
    plan = autopar.evaluate(oss, cluster="dgx-h100:nodes=1", global_batch=8, tp=2, pp=1, microbatch_size=1,
                            ep=4, etp=1)
    assert plan.predicted.breakdown_s["ep.dispatch"] > 0


def test_folded_experts_are_whole_on_tp_and_split_over_ep(graph) -> None:
    """Each rank holds num_experts / ep whole experts (not split by tp), sharded by ZeRO over the
    tp x dp / ep ranks holding the same ones."""
    planner = Planner(graph, Cluster.from_spec(CLUSTER), global_batch=16)
    experts = sum(param.meta.numel for param in graph.params if param.node in {op.param for op in planner.expert_ops})
    optimizer = {}
    for zero in (0, 1):
        config = ParallelConfig(dp=8, tp=2, pp=1, microbatch_size=1, num_microbatches=2, ep=8, etp=1, zero_stage=zero)
        assert config.expert_data_shards == 2
        stage = planner.evaluate(config)[0].stages[0]
        assert stage.expert_param_numel == pytest.approx(experts / 8)
        optimizer[zero] = stage.memory_bytes["optimizer"]
    assert optimizer[1] < optimizer[0]

"""The float8 expert grouped matmuls' terms (solver/fp8_experts.py) and which experts run in float8."""

from __future__ import annotations

import pytest

import autopar

LARGE = ("moe:layers=1,hidden=4096,heads=32,kv_heads=8,seq=2048,vocab=1024,ffn_hidden=14336,num_experts=8,top_k=2,"
         "expert_ffn_hidden=14336")
"""Mixtral-8x7B's expert shapes, one layer."""
NARROW = "moe:layers=1,hidden=256,heads=4,seq=4096,vocab=1024,num_experts=8,top_k=2,expert_ffn_hidden=16,ffn_hidden=256"
"""Many rows through 16-wide experts: the casts move far more bytes than the matmuls save."""
CONFIG = dict(cluster="dgx-h100:gpus_per_node=2", global_batch=8, precision="fp8", tp=1, pp=1, microbatch_size=4,
              ep=2, zero_stage=1)


def _linears_only(fqn: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2


@pytest.fixture(scope="module")
def large():
    """LARGE captured once (its plans below differ only in their fp8 filter)."""
    from autopar.models import build_model
    from autopar.plans.planning import capture_for_planning

    bundle = build_model(LARGE, device="meta", seed=0, batch_size=8)
    graph = capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, precision="bf16")
    return bundle, graph


def _large_plan(large, fp8_filter=None):
    from autopar.plans.planning import plan_with, planner_for
    from autopar.solver.constraints import Constraints

    bundle, graph = large
    planner = planner_for(graph, bundle.example_inputs, CONFIG["cluster"], global_batch=8, loss_fn=bundle.loss_fn,
                          example_targets=bundle.example_targets, precision="fp8", fp8_filter=fp8_filter)
    fixed = {key: CONFIG[key] for key in ("tp", "pp", "microbatch_size", "ep", "zero_stage")}
    return plan_with(planner, Constraints.from_value({**fixed, "recompute": "none"}))


def test_float8_experts_are_priced_faster_at_large_expert_shapes(large):
    both = _large_plan(large, lambda fqn, shape: True)
    linears = _large_plan(large, _linears_only)
    terms, bf16 = both.predicted.breakdown_s, linears.predicted.breakdown_s
    assert len(both.fp8_experts) == 2 and linears.fp8_experts == ()
    assert all(terms[name] > 0 for name in ("fp8.matmul.experts", "fp8.cast.experts", "fp8.copy.experts"))
    # The experts' bf16 grouped matmuls (and the busiest rank's extra rows) leave compute and
    # ep.load_imbalance, and come back at the fp8 rate with their casts and copies.
    moved = bf16["compute"] - terms["compute"] + bf16["ep.load_imbalance"] - terms.get("ep.load_imbalance", 0.0)
    assert terms["fp8.matmul.experts"] < moved < 2.5 * terms["fp8.matmul.experts"]
    assert both.predicted.step_time_s < linears.predicted.step_time_s
    assert both.predicted.memory_bytes["fp8.copies"] > linears.predicted.memory_bytes["fp8.copies"]
    assert any("2 of 2 expert weights' grouped matmuls in float8" in note for note in both.notes)
    # the planner's own choice (no filter) keeps them
    assert _large_plan(large).fp8_experts == both.fp8_experts


def test_experts_whose_casts_cost_more_than_they_save_stay_bf16_and_say_so():
    plan = autopar.evaluate(NARROW, **CONFIG)
    forced = autopar.evaluate(NARROW, **CONFIG, fp8_filter=lambda fqn, shape: True)
    assert plan.fp8_experts == () and len(forced.fp8_experts) == 2
    assert forced.predicted.breakdown_s["fp8.cast.experts"] > forced.predicted.breakdown_s["fp8.matmul.experts"]
    assert any("stay bf16: their float8 casts and copies would cost more" in note for note in plan.notes)


def test_expert_dims_torchao_cannot_take_stay_bf16_and_say_so():
    plan = autopar.evaluate("moe:layers=1,hidden=64,heads=4,seq=32,vocab=128,expert_ffn_hidden=40",
                            cluster="cpu:procs=2", global_batch=4, precision="fp8", ep=2, microbatch_size=2)
    assert plan.fp8_experts == ("layers.0.mlp.experts.w_gate_up",)  # [4, 64, 80]; w_down is [4, 40, 64]
    assert any("matmul dims 40 x 64 are not multiples of 16" in note for note in plan.notes)
    assert "1 expert weights' grouped matmuls in float8" in plan.summary()
    gshard = autopar.evaluate("moe:router=gshard,layers=1,hidden=32,heads=4,seq=16,vocab=64,num_experts=4",
                              cluster="cpu:procs=2", global_batch=4, precision="fp8", ep=2, microbatch_size=2)
    assert gshard.fp8_experts == () and any("einsum/bmm expert matmul" in note for note in gshard.notes)


def _as_framework(large, handling: str, global_batch: int = 8, experts: bool = True):
    """LARGE's published-run price with the casts as `handling` runs them (tp 1, ep 2, mb 4)."""
    from autopar.cluster import Cluster
    from autopar.plans.planning import fixed_config
    from autopar.solver.fp8 import Fp8Choice, fp8_experts, fp8_linears
    from autopar.solver.search import Planner

    _, graph = large
    chosen = fp8_experts(graph)[0] if experts else ()
    choice = Fp8Choice(linears=fp8_linears(graph), experts=chosen, handling=handling)
    planner = Planner(graph, Cluster.from_spec(CONFIG["cluster"]), global_batch=global_batch, precision="fp8",
                      fp8=choice)
    config = fixed_config(planner, tp=1, pp=1, dp=None, microbatch_size=4, schedule="1f1b", virtual_stages=None,
                          layers_per_virtual_stage=None, recompute="none", zero_stage=1, ep=2)
    return planner.evaluate(config)[0]


def test_transformer_engine_casts_each_expert_as_a_float8_linear(large):
    """TransformerEngine (Megatron-Core's SequentialMLP, TEGroupedMLP) runs each expert as a float8
    linear: one-pass casts of its rows and grad_output, its weight cast once per step and kept,
    no padding or re-layout copies; torchao's grouped casts and autopar's copies are its runtime's."""
    te, runtime = _as_framework(large, "te"), _as_framework(large, "compiled")
    te_terms, runtime_terms = te.breakdown_s, runtime.breakdown_s
    assert te_terms["fp8.matmul.experts"] == pytest.approx(runtime_terms["fp8.matmul.experts"])
    assert "fp8.copy.experts" not in te_terms and runtime_terms["fp8.copy.experts"] > 0
    assert 0 < te_terms["fp8.cast.experts"] < runtime_terms["fp8.cast.experts"]
    # the weights' casts are once per step: a second microbatch adds only the rows' casts
    twice = _as_framework(large, "te", global_batch=16).breakdown_s["fp8.cast.experts"]
    assert te_terms["fp8.cast.experts"] < twice < 2 * te_terms["fp8.cast.experts"]
    # and their float8 copies (row-major and transposed, 1 byte each) are kept through the step:
    # 4 of the 8 experts on a rank, gate_up [4096, 2 x 14336] and down [14336, 4096]
    held = te.memory_bytes["fp8.weights"] - _as_framework(large, "te", experts=False).memory_bytes["fp8.weights"]
    assert held == pytest.approx(2 * 4 * 3 * 4096 * 14336)

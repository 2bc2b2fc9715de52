"""Expert parallelism: which ops are expert matmuls, what ep costs and saves, when the search picks it,
and the exchanges of codegen/experts.py (on one process: the all-to-all of a group of one is the
identity, so dispatch + combine must give back the op's own result)."""

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.graph import OpNode, Ref, TensorMeta
from autopar.models import build_model
from autopar.solver.experts import find_expert_ops
from autopar.strategies import mesh_strategies

TINY_MOE = "moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4"
# Experts dominate: 64 experts of 1024 x 4096 per layer (8.6B expert parameters over 16 layers,
# 0.2B elsewhere), on 8 DGX H100 nodes.
BIG_MOE = "moe:layers=16,hidden=1024,heads=16,seq=1024,vocab=32000,num_experts=64,top_k=2,ffn_hidden=4096"
BIG_CLUSTER = "dgx-h100:nodes=8"


@pytest.fixture(scope="module")
def tiny_graph():
    bundle = build_model(TINY_MOE, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                            example_targets=bundle.example_targets)


def test_the_moe_expert_einsums_are_found(tiny_graph) -> None:
    ops = find_expert_ops(tiny_graph)
    params = {tiny_graph[op.param].target for op in ops}
    assert params == {f"layers.{i}.mlp.{name}" for i in range(2) for name in ("w_in", "w_out")}
    for op in ops:
        assert op.num_experts == 4
        node = tiny_graph[op.node]
        token = tiny_graph[node.inputs[op.token_input]].output
        assert token.shape[op.token_expert_dim] == 4 and node.output.shape[op.output_expert_dim] == 4


def test_a_dense_model_has_no_expert_ops() -> None:
    bundle = build_model("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64", device="meta", batch_size=2)
    graph = autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                             example_targets=bundle.example_targets)
    assert find_expert_ops(graph) == ()
    with pytest.raises(ConfigError, match="no expert matmuls"):
        autopar.plan(graph, cluster="dgx-h100:nodes=1", global_batch=8, constraints={"ep": 2, "tp": 1})


def _evaluate(graph, **config):
    return autopar.evaluate(graph, cluster="dgx-h100:nodes=1", global_batch=16, microbatch_size=2, **config)


def test_ep_splits_expert_states_and_adds_all_to_alls(tiny_graph) -> None:
    without = _evaluate(tiny_graph, tp=1, pp=1, dp=8)
    with_ep = _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=4)
    ops = find_expert_ops(tiny_graph)
    expert_numel = sum(tiny_graph[op.param].output.numel for op in ops)
    saved = without.predicted.memory_bytes["parameters"] - with_ep.predicted.memory_bytes["parameters"]
    assert saved == pytest.approx(expert_numel * (1 - 1 / 4) * 2)  # bf16 working copy
    assert with_ep.predicted.breakdown_s["ep.all_to_all"] > 0 and "ep.all_to_all" not in without.predicted.breakdown_s
    # Per expert op: dispatch and combine forward, and both again backward.
    counts = with_ep.predicted.collectives_per_microbatch
    assert counts.get("all_to_all", 0) - without.predicted.collectives_per_microbatch.get("all_to_all", 0) \
        == 4 * len(ops)
    assert with_ep.ep == 4 and set(with_ep.ep_params) == {tiny_graph[op.param].target for op in ops}
    assert "ep=4" in with_ep.summary()


def test_ep_constraints_are_checked(tiny_graph) -> None:
    with pytest.raises(ConfigError, match="offload"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=2, zero_stage=3, offload=True)
    with pytest.raises(ConfigError, match="must divide dp"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=3)
    with pytest.raises(ConfigError, match="do not split evenly"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=8)  # 4 experts


def test_a_model_whose_experts_dominate_memory_is_planned_expert_parallel() -> None:
    plan = autopar.plan(BIG_MOE, cluster=BIG_CLUSTER, global_batch=256)
    assert plan.ep > 1, plan.summary()
    assert plan.predicted.breakdown_s["ep.all_to_all"] > 0
    assert plan.mesh["dp"] % plan.ep == 0


def test_a_small_moe_need_not_be() -> None:
    plan = autopar.plan(TINY_MOE, cluster="dgx-h100:nodes=1", global_batch=16)
    assert plan.ep == 1, plan.summary()


def test_expert_grouped_mm_prices_the_partial_token_gradient() -> None:
    """Each device holds its experts' rows of the token gradient: the planner must price the
    all-reduce codegen runs for it (issue 12's missing backward all-reduce)."""
    metas = [TensorMeta(shape=(12, 8), dtype="float32"), TensorMeta(shape=(4, 8, 6), dtype="float32"),
             TensorMeta(shape=(4,), dtype="int32")]
    node = OpNode(name="gmm", kind="call", target="transformers.grouped_mm_fallback.default", inputs=("x", "w", "o"),
                  args=(Ref(index=0), Ref(index=1), Ref(index=2)),
                  outputs=(TensorMeta(shape=(12, 6), dtype="float32"),))
    by_name = {strategy.name: strategy for strategy in mesh_strategies(node, metas, (2,))}
    assert by_name["expert"].input_grad(0, 0, True) == "P"
    assert by_name["expert"].input_grad(1, 0, True) == "S0"
    assert by_name["col"].input_grad(0, 0, True) == "P"
    assert by_name["row"].input_grad(0, 0, True) == "S1"


def test_dispatch_compute_combine_equals_the_whole_op_on_each_rank() -> None:
    """Two ranks simulated in lockstep: the exchange (block j of rank r -> rank j, as
    all_to_all_single does) of the built-in MoE's expert einsum gives each rank its own result."""
    from autopar.codegen.experts import join_blocks, split_blocks

    ep, generator = 2, torch.Generator().manual_seed(0)
    weight = torch.randn(4, 5, 3, generator=generator)  # [e, m, f]
    tokens = [torch.randn(4, 2, 6, 5, generator=generator) for _ in range(ep)]  # per rank [e, g, c, m]
    exchange = lambda blocks: [torch.stack([blocks[source][rank] for source in range(ep)])  # noqa: E731
                               for rank in range(ep)]
    received = exchange([split_blocks(x, 0, ep) for x in tokens])
    dispatched = [join_blocks(blocks, 1) for blocks in received]  # [e/ep, ep*g, c, m]
    local = [torch.einsum("egcm,emf->egcf", x, weight[2 * rank:2 * rank + 2]) for rank, x in enumerate(dispatched)]
    returned = exchange([split_blocks(y, 1, ep) for y in local])
    for rank in range(ep):
        torch.testing.assert_close(join_blocks(returned[rank], 0), torch.einsum("egcm,emf->egcf", tokens[rank], weight))


def test_grouped_rows_received_from_each_rank_are_put_in_expert_order() -> None:
    from autopar.codegen.experts import _expert_major

    # Rows received: from rank 0 one of expert 0 then two of expert 1, from rank 1 three of expert 0.
    order = _expert_major(torch.tensor([[1, 2], [3, 0]]))
    assert order.tolist() == [0, 3, 4, 5, 1, 2]

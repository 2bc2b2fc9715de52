"""Expert parallelism: which ops are expert matmuls, what ep costs and saves, when the search picks it,
and the exchanges of codegen/experts.py (on one process: the all-to-all of a group of one is the
identity, so dispatch + combine must give back the op's own result)."""

import json
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.errors import ConfigError
from autopar.graph import OpGraph, OpNode, ParamInfo, Ref, TensorMeta
from autopar.models import build_model
from autopar.plans.plan import Plan
from autopar.solver.experts import ExpertExchange, ExpertPricing, GroupedMatmul, expert_ops_at, find_expert_ops
from autopar.strategies import mesh_strategies
from cost_model.compute import ComputeModel

TINY_MOE = "moe:router=gshard,layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4"
# Experts dominate: 64 experts of 1024 x 4096 per layer (8.6B expert parameters over 16 layers,
# 0.2B elsewhere), on 8 DGX H100 nodes.
BIG_MOE = ("moe:router=gshard,layers=16,hidden=1024,heads=16,seq=1024,vocab=32000,num_experts=64,top_k=2,"
           "expert_ffn_hidden=4096")
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
    for part in ("ep.dispatch", "ep.combine"):  # the all-to-alls, named by what they move
        assert with_ep.predicted.breakdown_s[part] > 0 and part not in without.predicted.breakdown_s
    # Per layer (its two expert einsums chained through the gelu): dispatch and combine forward,
    # and both again backward.
    assert all(op.chain_from or op.chain_to for op in ops)
    counts = with_ep.predicted.collectives_per_microbatch
    assert counts.get("all_to_all", 0) - without.predicted.collectives_per_microbatch.get("all_to_all", 0) \
        == 4 * len(ops) // 2
    assert with_ep.ep == 4 and set(with_ep.ep_params) == {tiny_graph[op.param].target for op in ops}
    assert "ep=4" in with_ep.summary()


def test_ep_constraints_are_checked(tiny_graph) -> None:
    with pytest.raises(ConfigError, match="offload"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=2, zero_stage=3, offload=True)
    with pytest.raises(ConfigError, match="must divide dp"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=3)
    with pytest.raises(ConfigError, match="do not split evenly"):
        _evaluate(tiny_graph, tp=1, pp=1, dp=8, ep=8)  # 4 experts


def test_a_model_whose_experts_dominate_memory_plans_with_a_fixed_expert_parallel_degree() -> None:
    # Not chosen unprompted since all-to-alls across nodes go through each device's own NIC
    # (cost_model/comm.py): the ep=32 this once picked spanned 4 nodes at 8x that bandwidth.
    plan = autopar.plan(BIG_MOE, cluster=BIG_CLUSTER, global_batch=256, constraints={"ep": 8})
    assert plan.ep == 8, plan.summary()
    assert plan.predicted.breakdown_s["ep.dispatch"] > 0 and plan.predicted.breakdown_s["ep.combine"] > 0
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


def test_one_local_expert_keeps_the_received_rows_as_they_came(one_process_group) -> None:
    """With one expert per rank the rows arrive expert-major: neither dispatch nor combine reorders."""
    import torch.distributed as dist

    from autopar.codegen.experts import combine_rows, dispatch_rows

    tokens = torch.arange(12.0).reshape(6, 2)
    rows = dispatch_rows(tokens, torch.tensor([5], dtype=torch.int32), dist.group.WORLD, 1)
    assert rows.route.order is None and rows.route.local_offsets.tolist() == [5]
    torch.testing.assert_close(rows.value, tokens[:5])
    torch.testing.assert_close(combine_rows(rows.value * 2, rows.route, dist.group.WORLD),
                               torch.cat([tokens[:5] * 2, torch.zeros(1, 2)]))


def test_a_reorder_reads_and_writes_its_rows_once_unless_the_dispatch_fuses_it() -> None:
    compute = ComputeModel(Cluster.from_spec("dgx-h100:nodes=1").device)
    pricing = ExpertPricing(load_imbalance=1.0)
    assert pricing.reorder_s(1e9, 16, 8, compute) == pytest.approx(2e9 / compute.bandwidth_bytes_per_s
                                                                   + compute.overhead_s)
    assert pricing.reorder_s(1e9, 8, 8, compute) == 0.0  # one expert per rank: already expert-major
    assert pricing.reorder_s(1e9, 16, 1, compute) == 0.0  # no ep
    assert ExpertPricing(fused_permute=True).reorder_s(1e9, 16, 8, compute) == 0.0  # DeepEP / HybridEP


@pytest.fixture(scope="module")
def mixtral_graph():
    """Hugging Face's Mixtral (grouped matmuls over tokens sorted by expert: dropless), tiny, on meta."""
    transformers = pytest.importorskip("transformers")
    from hf_meta import capture_causal_lm

    config = transformers.MixtralConfig(use_cache=False, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        num_local_experts=8, num_experts_per_tok=2)
    return capture_causal_lm(transformers.MixtralForCausalLM, config)


def test_dropless_grouped_experts_price_dispatch_combine_counts_and_the_stated_imbalance(mixtral_graph) -> None:
    ops = find_expert_ops(mixtral_graph)
    assert ops and all(op.kind == "grouped_mm" and op.dropless for op in ops)
    balanced = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4, moe_load_imbalance=1.0)
    skewed = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4, moe_load_imbalance=1.5)
    default = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4)
    for part in ("ep.dispatch", "ep.combine", "ep.counts"):
        assert balanced.predicted.breakdown_s[part] > 0, part
    assert "ep.load_imbalance" not in balanced.predicted.breakdown_s
    assert skewed.predicted.breakdown_s["ep.load_imbalance"] > 0
    assert skewed.predicted.breakdown_s["ep.dispatch"] > balanced.predicted.breakdown_s["ep.dispatch"]
    assert skewed.predicted.step_time_s > default.predicted.step_time_s > balanced.predicted.step_time_s
    assert (balanced.moe_load_imbalance, skewed.moe_load_imbalance, default.moe_load_imbalance) == (1.0, 1.5, 1.25)
    assert "load imbalance 1.5" in skewed.summary()
    assert Plan.from_dict(json.loads(skewed.to_json())).moe_load_imbalance == 1.5


def test_the_rows_are_reordered_around_the_exchanges_where_a_rank_holds_more_than_one_expert(mixtral_graph) -> None:
    two = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4, moe_load_imbalance=1.0).predicted  # 8 experts / ep 4
    one = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=8, moe_load_imbalance=1.0).predicted
    assert two.breakdown_s["ep.reorder"] > 0
    assert "ep.reorder" not in one.breakdown_s


def test_the_load_imbalance_is_checked_and_only_recorded_for_models_with_experts(mixtral_graph) -> None:
    for bad in (0.99, float("nan"), float("inf"), "1.5", True):
        with pytest.raises(ConfigError, match="load imbalance"):
            _evaluate(mixtral_graph, tp=1, pp=1, dp=8, moe_load_imbalance=bad)
    dense = build_model("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64", device="meta", batch_size=2)
    plan = autopar.evaluate(dense.model, dense.example_inputs, "dgx-h100:nodes=1", global_batch=16, microbatch_size=2,
                            loss_fn=dense.loss_fn, example_targets=dense.example_targets, moe_load_imbalance=1.0)
    assert plan.moe_load_imbalance is None and "load imbalance" not in plan.summary()


def test_router_and_token_permutation_ops_are_priced_as_memory_kernels(mixtral_graph) -> None:
    """The router (softmax, top-k), the sort of tokens by expert, their counts and the gathers and
    scatters that permute and un-permute them are graph ops: each is priced (never zero) and none
    as a matmul; only the expert matmuls themselves are grouped matmul kernels."""
    compute = ComputeModel(Cluster.from_spec("dgx-h100").device)
    routing = ("softmax", "topk", "sort", "histc", "cumsum", "index.Tensor", "index_put", "index_add", "scatter",
               "gather")
    found = set()
    for node in mixtral_graph.calls():
        name = next((word for word in routing if word in node.target), None)
        if name is None:
            continue
        found.add(name)
        kernels = node.fwd_kernels + node.bwd_kernels
        assert not any(kernel.is_matmul for kernel in kernels), node.target
        assert compute.kernels(node.fwd_kernels).total_s > 0, node.target
    assert {"softmax", "topk", "sort", "histc", "index.Tensor"} <= found


def test_expert_parallel_grouped_matmuls_run_fewer_bigger_experts(mixtral_graph) -> None:
    """Without ep a device runs all 8 experts' matmuls on its own tokens (S / 8 rows each); with
    ep=4 it runs 2 experts on the group's tokens for them (4 x the rows each): the same FLOPs at a
    better rate, so the stage's compute falls; the load imbalance is priced on those shapes."""
    alone = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, moe_load_imbalance=1.0)
    grouped = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4, moe_load_imbalance=1.0)
    assert grouped.predicted.breakdown_s["compute"] < alone.predicted.breakdown_s["compute"]
    compute = ComputeModel(Cluster.from_spec("dgx-h100").device)
    matmul = GroupedMatmul(phase="fwd", flops=1e10, experts=8, dtype="bfloat16")
    assert matmul.time_s(compute, 4) < matmul.time_s(compute)  # 2 experts of 4x the rows
    assert matmul.time_s(compute, 4) < matmul.time_s(compute, 4, 1.5) < 1.5 * matmul.time_s(compute, 4)


def test_expert_parallelism_divides_the_weights_a_grouped_matmul_reads() -> None:
    """A device running all 64 experts on 64 rows each reads every expert's weights: the kernel
    is bound by those bytes, as the segment's compute prices it. Under ep=8 it reads 8 experts'
    weights (the rows stay as many, times the load imbalance): its time there, and what ep saves,
    count that."""
    compute = ComputeModel(Cluster.from_spec("dgx-h100").device)
    rows, hidden, ffn, experts = 4096, 4096, 4096, 64
    weights, row_bytes, flops = 2.0 * experts * hidden * ffn, 2.0 * rows * (hidden + ffn), 2.0 * rows * hidden * ffn
    matmul = GroupedMatmul(phase="fwd", flops=flops, experts=experts, dtype="bfloat16",
                           io_bytes=row_bytes + weights, expert_bytes=weights)
    bandwidth = compute.bandwidth_bytes_per_s
    assert matmul.time_s(compute) == pytest.approx((row_bytes + weights) / bandwidth)
    assert matmul.time_s(compute) > compute.grouped_matmul_s(flops, flops / experts, "bfloat16")
    assert matmul.time_s(compute, 8) == pytest.approx(max(compute.grouped_matmul_s(flops, flops / 8, "bfloat16"),
                                                          (row_bytes + weights / 8) / bandwidth))
    assert matmul.time_s(compute, 8, 1.5) == pytest.approx(max(compute.grouped_matmul_s(1.5 * flops, 1.5 * flops / 8,
                                                                                        "bfloat16"),
                                                               (1.5 * row_bytes + weights / 8) / bandwidth))


def test_what_ep_saves_is_measured_from_the_grouped_matmuls_priced_time(mixtral_graph) -> None:
    """GroupedMatmul.alone_s is the kernel's time in the segment's compute (the roofline of its
    FLOPs and bytes): ep's change of shape replaces that time, never a lower one."""
    from autopar import api

    planner = api.planner_for(mixtral_graph, None, "dgx-h100:nodes=1", global_batch=16, moe_load_imbalance=1.0)
    config = api.fixed_config(planner, tp=1, pp=1, dp=8, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                              layers_per_virtual_stage=None, recompute="none", zero_stage=0, ep=8)
    prepared = planner.pricing.prepared_for(config)
    compute = planner.pricing.step_model.compute
    matmuls = [matmul for segment in prepared.ep_matmuls for matmul in segment]
    assert matmuls and all(matmul.expert_bytes > 0 for matmul in matmuls)
    for matmul in matmuls:
        assert matmul.alone_s == pytest.approx(matmul.time_s(compute))
        assert matmul.alone_s >= compute.grouped_matmul_s(matmul.flops, matmul.flops / matmul.experts, matmul.dtype)


def test_the_search_lower_bound_holds_for_expert_parallel_configurations(mixtral_graph) -> None:
    """ep makes the grouped expert matmuls faster than in the segments' own price: the bound that
    prunes configurations must stay below their priced step time."""
    from autopar import api
    from autopar.solver.pricing import lower_bound_s

    planner = api.planner_for(mixtral_graph, None, "dgx-h100:nodes=1", global_batch=16, moe_load_imbalance=1.0)
    for pp, ep in ((1, 2), (1, 8), (2, 4)):
        config = api.fixed_config(planner, tp=1, pp=pp, dp=8 // pp, microbatch_size=1, schedule="1f1b",
                                  virtual_stages=None, layers_per_virtual_stage=None, recompute="none",
                                  zero_stage=0, ep=ep)
        estimate, _ = planner.evaluate(config)
        assert lower_bound_s(planner.pricing.least_work(config), config) <= estimate.step_time_s


def _swiglu_graph(outside_reader: bool = False, row_mixing: bool = False) -> OpGraph:
    """A grouped-mm SwiGLU expert layer: gate_up, chunk, silu(gate) * up, down (the `offs` shared);
    optionally the silu also read outside the layer, or a cumsum over the rows before `down`."""
    rows, hidden, ffn, experts = 12, 8, 6, 4
    meta = lambda *shape, dtype="float32": TensorMeta(shape=shape, dtype=dtype)  # noqa: E731
    refs = lambda n: tuple(Ref(index=i) for i in range(n))  # noqa: E731

    def call(name, target, inputs, args, *outputs):
        return OpNode(name=name, kind="call", target=target, inputs=inputs, args=args, outputs=outputs,
                      requires_grad=True)

    nodes = [OpNode(name="x", kind="input", target="x", outputs=(meta(rows, hidden),)),
             OpNode(name="offs", kind="input", target="offs", outputs=(meta(experts, dtype="int32"),)),
             OpNode(name="w1", kind="param", target="w1", outputs=(meta(experts, hidden, 2 * ffn),),
                    requires_grad=True),
             OpNode(name="w2", kind="param", target="w2", outputs=(meta(experts, ffn, hidden),), requires_grad=True),
             call("gmm1", "aten._grouped_mm.default", ("x", "w1", "offs"), refs(3), meta(rows, 2 * ffn)),
             call("chunk", "aten.chunk.default", ("gmm1",), (Ref(index=0), 2, -1), meta(rows, ffn), meta(rows, ffn)),
             call("gate", "getitem", ("chunk",), (Ref(index=0), 0), meta(rows, ffn)),
             call("up", "getitem", ("chunk",), (Ref(index=0), 1), meta(rows, ffn)),
             call("silu", "aten.silu.default", ("gate",), refs(1), meta(rows, ffn)),
             call("mul", "aten.mul.Tensor", ("silu", "up"), refs(2), meta(rows, ffn))]
    tokens = "mul"
    if row_mixing:
        nodes.append(call("mixed", "aten.cumsum.default", ("mul",), (Ref(index=0), 0), meta(rows, ffn)))
        tokens = "mixed"
    nodes.append(call("gmm2", "aten._grouped_mm.default", (tokens, "w2", "offs"), refs(3), meta(rows, hidden)))
    outputs = ("gmm2",)
    if outside_reader:
        nodes.append(call("total", "aten.sum.default", ("silu",), refs(1), meta()))
        outputs += ("total",)
    nodes.append(OpNode(name="output", kind="output", target="output", inputs=outputs, args=refs(len(outputs))))
    params = tuple(ParamInfo(name=name, node=name, meta=node.output, trainable=True)
                   for name, node in ((n.name, n) for n in nodes if n.kind == "param"))
    return OpGraph(nodes=tuple(nodes), params=params, blocks=(), segments=(), batch_size=1, batch_dynamic=False,
                   capture_method="export")


def test_a_swiglu_grouped_mm_layer_is_one_chain() -> None:
    first, last = find_expert_ops(_swiglu_graph())
    assert (first.node, first.chain_from, first.chain_to) == ("gmm1", "", "gmm2")
    assert (last.node, last.chain_from, last.chain_to) == ("gmm2", "gmm1", "")
    assert last.between == ("chunk", "gate", "up", "silu", "mul")
    # Under tensor parallelism the chain runs where no tp placement splits its rows (the ops
    # between then run on the same dispatched rows on every tp rank); elsewhere each op exchanges.
    columns = {"gmm1": (("S1",), (("R",), ("S2",), ("R",))), "silu": (("S1",), (("S1",),))}
    assert expert_ops_at((first, last), lambda name: columns.get(name)) == (first, last)
    rows = {**columns, "silu": (("S0",), (("S0",),))}
    assert all(not op.chain_from and not op.chain_to and not op.between
               for op in expert_ops_at((first, last), lambda name: rows.get(name)))


@pytest.mark.parametrize("breaker", ["outside_reader", "row_mixing"])
def test_an_outside_reader_or_a_row_mixing_op_breaks_the_chain(breaker) -> None:
    ops = find_expert_ops(_swiglu_graph(**{breaker: True}))
    assert [op.node for op in ops] == ["gmm1", "gmm2"]
    assert all(not op.chain_from and not op.chain_to and not op.between for op in ops)


def test_the_hf_and_builtin_grouped_layers_chain(mixtral_graph) -> None:
    bundle = build_model("moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4", device="meta", batch_size=2)
    builtin = autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                           example_targets=bundle.example_targets)
    for graph in (mixtral_graph, builtin):
        ops = find_expert_ops(graph)
        starts = [op for op in ops if op.chain_to]
        assert len(starts) == 2 and len(ops) == 4  # two layers, one chain each
        for op in starts:
            end = next(other for other in ops if other.node == op.chain_to)
            assert end.chain_from == op.node and any("silu" in graph[name].target for name in end.between)


def test_a_chain_exchanges_its_first_input_and_its_last_output_only() -> None:
    """SwiGLU, Mixtral's shape (F = 3.5 H): per op, H in + 2F out and F in + H out; chained, H + H."""
    hidden, ffn = 2.0, 7.0
    ops = dict(token_grad=True, dropless=True, compute_s=0.0, count_bytes=64.0)
    first = ExpertExchange(token_bytes=hidden, output_bytes=2 * ffn, **ops)
    last = ExpertExchange(token_bytes=ffn, output_bytes=hidden, **ops)
    alone = [message for exchange in (first, last) for message in exchange.messages()]
    chained = [message for exchange in (replace(first, combines=False), replace(last, dispatches=False))
               for message in exchange.messages()]
    assert sorted((phase, part) for _, phase, part in chained) == [
        ("bwd", "combine"), ("bwd", "dispatch"), ("fwd", "combine"), ("fwd", "counts"), ("fwd", "dispatch")]
    moved = lambda messages: sum(size for size, _, part in messages if part != "counts")  # noqa: E731
    assert moved(chained) == 4 * hidden and moved(alone) == 4 * hidden + 6 * ffn
    assert len(alone) == 10 and len(chained) == 5


def test_chained_grouped_experts_predict_five_all_to_alls_per_layer(mixtral_graph) -> None:
    plan = _evaluate(mixtral_graph, tp=1, pp=1, dp=8, ep=4)
    dense = _evaluate(mixtral_graph, tp=1, pp=1, dp=8)
    added = plan.predicted.collectives_per_microbatch.get("all_to_all", 0) \
        - dense.predicted.collectives_per_microbatch.get("all_to_all", 0)
    assert added == 5 * 2  # counts, dispatch, combine forward; dispatch, combine backward; 2 layers


WIDE_MOE = ("moe:layers=1,hidden=1024,heads=8,kv_heads=4,seq=1024,vocab=512,num_experts=8,top_k=2,"
            "expert_ffn_hidden=4096")
"""Experts wide enough that the tp solve splits them by column and row, not by expert."""


@pytest.fixture(scope="module")
def wide_moe_graph():
    bundle = build_model(WIDE_MOE, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_targets=bundle.example_targets)


def _wide_moe_priced(graph, *, tp: int, ep: int, share: bool = False):
    from autopar import api
    from autopar.solver.search import SearchOptions

    options = SearchOptions(experts=ExpertPricing(load_imbalance=1.0, tp_share_dispatch=share))
    planner = api.planner_for(graph, None, "dgx-h100:nodes=2", global_batch=32, options=options)
    config = api.fixed_config(planner, tp=tp, pp=1, dp=16 // tp, microbatch_size=2, schedule="1f1b",
                              virtual_stages=None, layers_per_virtual_stage=None, recompute="none", zero_stage=0,
                              ep=ep)
    return planner.evaluate(config)


def test_the_builtin_experts_run_column_then_row_parallel_on_tp(wide_moe_graph) -> None:
    """The family interleaves gate and up in w_gate_up's columns, so under tp (etp = tp) the gate/up
    grouped matmul splits its columns and the down one its rows, Megatron-Core's expert tensor
    parallelism: no [rows, 2 x expert_ffn_hidden] intermediate crosses the tp ranks (with the two
    halves concatenated, the planner split the first matmul along its input and reduce-scattered
    that intermediate, 2 x 4096 / 1024 = 8x a token's bytes here). The solve never splits the
    experts by expert on tp (ep's split)."""
    graph = wide_moe_graph
    _, result = _wide_moe_priced(graph, tp=2, ep=4)
    gate_up, down = [node for node in graph.calls() if "grouped_mm" in node.target]
    assert result.strategies[gate_up.name].inputs[1] == ("S2",)  # [E, K, 2F]: columns
    assert result.strategies[down.name].inputs[1] == ("S1",)  # [E, F, K]: rows
    token_bytes = graph[gate_up.inputs[0]].output.nbytes  # every (token, choice) row of a microbatch of 2
    assert max(event.message_bytes for segment in result.segments for event in segment.comm) <= token_bytes


def test_the_tp_solve_never_splits_experts_by_expert() -> None:
    """Small experts made splitting by expert over tp the cheapest placement (each tp rank its own
    experts for every row), which expert parallelism cannot combine with; the solve leaves that
    split to ep: on tp the experts run whole, column- or row-parallel, and ep prices."""
    from autopar import api

    bundle = build_model("moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4", device="meta", batch_size=2)
    graph = autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                         example_targets=bundle.example_targets)
    planner = api.planner_for(graph, None, "dgx-h100:nodes=1", global_batch=16)
    strategies = planner.pricing.sharding(2, 2).strategies
    weights = [strategies[node.name].inputs[1] for node in graph.calls() if "grouped_mm" in node.target]
    assert weights and all("S0" not in placement for placement in weights)
    config = api.fixed_config(planner, tp=2, pp=1, dp=4, microbatch_size=2, schedule="1f1b", virtual_stages=None,
                              layers_per_virtual_stage=None, recompute="none", zero_stage=0, ep=2)
    assert planner.evaluate(config)[0].breakdown_s["ep.dispatch"] > 0


def test_megatrons_tp_share_dispatch_moves_one_tp_share_of_the_rows(wide_moe_graph) -> None:
    """Megatron-Core's dispatcher sends each tp rank's share of the rows and gathers them over tp
    after the all-to-all (ExpertPricing.tp_share_dispatch): the all-to-alls shrink by tp, the tp
    group's gather and reduce-scatter are priced beside them; at tp = 1 nothing changes."""
    def parts(share: bool, tp: int) -> dict[str, float]:
        estimate, _ = _wide_moe_priced(wide_moe_graph, tp=tp, ep=4, share=share)
        return {name: seconds for name, seconds in estimate.breakdown_s.items() if name.startswith("ep.")}

    whole, shared = parts(False, 2), parts(True, 2)
    assert shared["ep.dispatch"] < whole["ep.dispatch"] and shared["ep.combine"] < whole["ep.combine"]
    assert shared["ep.tp_all_gather"] > 0 and shared["ep.tp_reduce_scatter"] > 0
    assert "ep.tp_all_gather" not in whole and "ep.tp_rows_replaced" not in whole
    assert parts(True, 1) == parts(False, 1)


def test_megatrons_dispatch_replaces_the_plans_gather_and_reduction_of_the_layer(wide_moe_graph) -> None:
    """Each tp rank routes its own rows under Megatron's dispatcher: the plan's collectives that
    give every tp rank the MoE layer's rows whole (an all-gather of its input, where it arrives
    sequence-sharded) and reduce its output are recorded as the region's (SegmentCost.expert_region_comm) and taken off
    ("ep.tp_rows_replaced", negative), leaving the tp collectives outside the layer."""
    estimate, result = _wide_moe_priced(wide_moe_graph, tp=2, ep=4, share=True)
    region = [event for segment in result.segments for event in segment.expert_region_comm]
    assert any(event.op in ("all_reduce", "reduce_scatter") for event in region if event.phase == "fwd")
    assert all(any(event is other for segment in result.segments for other in segment.comm) for event in region)
    breakdown = estimate.breakdown_s
    tp_comm = sum(seconds for name, seconds in breakdown.items() if name.startswith("tp.") and "once" not in name)
    assert 0 < -breakdown["ep.tp_rows_replaced"] < tp_comm
    unshared, _ = _wide_moe_priced(wide_moe_graph, tp=2, ep=4)
    assert "ep.tp_rows_replaced" not in unshared.breakdown_s


def test_context_parallelism_splits_the_grouped_matmuls_rows_not_their_weights() -> None:
    """Under cp each rank's expert ops see 1 / cp of the rows: their FLOPs and row bytes shrink,
    the experts' weights they read do not, and their time without ep is re-priced on that shape."""
    from autopar.solver.context_parallel import split_sequence
    from autopar.solver.evaluate import SegmentCost
    from cost_model.comm import CommModel

    cluster = Cluster.from_spec("dgx-h100")
    compute = ComputeModel(cluster.device)
    matmul = GroupedMatmul(phase="fwd", flops=2e12, experts=8, dtype="bfloat16", io_bytes=3e9, expert_bytes=2e9)
    matmul = replace(matmul, alone_s=matmul.time_s(compute))
    exchange = ExpertExchange(token_bytes=1e8, output_bytes=1e8, token_grad=True, dropless=True, compute_s=0.01,
                              matmuls=(matmul,))
    segment = SegmentCost(name="layers.0", expert_exchanges=[exchange])
    (split,) = split_sequence(segment, [], cp=4, tp=1, comm=CommModel(cluster), devices_per_node=8,
                              compute_model=compute).expert_exchanges[0].matmuls
    assert split.flops == pytest.approx(5e11) and split.expert_bytes == 2e9
    assert split.io_bytes == pytest.approx(1e9 / 4 + 2e9)
    assert split.alone_s == pytest.approx(split.time_s(compute)) and split.alone_s > matmul.alone_s / 4

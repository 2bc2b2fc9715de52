"""solver/dtensor_ops.py: the ops codegen runs on local tensors are not priced as DTensor dispatch."""

from types import SimpleNamespace

from autopar.graph import OpNode, TensorMeta
from autopar.solver.dtensor_ops import runs_on_dtensors
from autopar.strategies import Strategy

META = TensorMeta(shape=(4, 8), dtype="float32")


def _graph(*nodes: OpNode):
    weight = OpNode(name="w", kind="param", target="w", outputs=(META,), requires_grad=True)
    source = OpNode(name="x", kind="call", target="aten.relu.default", outputs=(META,), requires_grad=True)
    return SimpleNamespace(by_name={node.name: node for node in (weight, source, *nodes)})


def _node(target: str, *inputs: str, alias: int | None = None) -> OpNode:
    return OpNode(name="op", kind="call", target=target, inputs=inputs, outputs=(META,), alias_input=alias,
                  requires_grad=True)


def _strategy(output: str, *inputs: str) -> Strategy:
    return Strategy(inputs=tuple((item,) for item in inputs), output=(output,), split_axes=(output != "R",))


def test_replicated_ops_and_shard_local_ops_run_locally():
    node = _node("aten.layer_norm.default", "x", "w")
    assert not runs_on_dtensors(_graph(node), node, _strategy("R", "R", "R"), fused_wgrad=False)
    node = _node("aten.gelu.default", "x")
    assert not runs_on_dtensors(_graph(node), node, _strategy("S1", "S1"), fused_wgrad=False)


def test_partial_operands_sharded_weights_and_attention_dispatch_through_dtensor():
    linear = _node("aten.linear.default", "x", "w")
    assert runs_on_dtensors(_graph(linear), linear, _strategy("P", "S1", "S0"), fused_wgrad=False)
    assert runs_on_dtensors(_graph(linear), linear, _strategy("S1", "R", "S0"), fused_wgrad=False)
    attention = _node("aten.scaled_dot_product_attention.default", "x", "x", "x")
    assert runs_on_dtensors(_graph(attention), attention, _strategy("R", "R", "R", "R"), fused_wgrad=False)


def test_replicated_linears_run_locally_unless_their_weight_gradient_is_fused_and_views_of_weights_never():
    linear = _node("aten.linear.default", "x", "w")
    assert not runs_on_dtensors(_graph(linear), linear, _strategy("R", "R", "R"), fused_wgrad=False)
    assert runs_on_dtensors(_graph(linear), linear, _strategy("R", "R", "R"), fused_wgrad=True)
    view = _node("aten.t.default", "w", alias=0)
    assert runs_on_dtensors(_graph(view), view, _strategy("R", "R"), fused_wgrad=False)


def test_every_repeated_block_counts_as_the_block_the_solve_priced():
    """The intra-op solve condenses identical blocks: blocks it did not solve count the DTensor
    ops of the one it did, not every op (overheads.segment_counts)."""
    from autopar.cluster import Cluster
    from autopar.models import build_model
    from autopar.plans.planning import capture_for_planning
    from autopar.solver.search import Planner
    from cost_model.memory import FP32_ADAM

    bundle = build_model("gpt:layers=6,hidden=64,heads=4,seq=16,vocab=64,dropout=0.0", device="meta", batch_size=8)
    graph = capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets)
    planner = Planner(graph, Cluster.from_spec("cpu:procs=4"), global_batch=8, policy=FP32_ADAM, precision="fp32")
    counts = planner.pricing.counts(2, 8)
    blocks = [counts[f"layers.{index}"] for index in range(6)]
    assert len({block.num_dtensor_dispatches for block in blocks}) == 1
    assert 0 < blocks[0].num_dtensor_dispatches < blocks[0].num_dispatches  # local runs are not counted


def test_attention_on_cpu_dtensors_counts_the_math_kernels_ops():
    """On CPU the runtime runs attention on DTensors through torch's math kernel (codegen's
    _cpu_attention), so a CPU plan counts that kernel's ops, a GPU plan the fused kernel's."""
    from autopar.cluster import Cluster
    from autopar.models import build_model
    from autopar.plans.planning import capture_for_planning
    from autopar.solver.overheads import segment_counts
    from autopar.solver.search import Planner
    from cost_model.memory import FP32_ADAM

    bundle = build_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=16,vocab=64", device="meta", batch_size=8)
    graph = capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets)
    planner = Planner(graph, Cluster.from_spec("cpu:procs=4"), global_batch=8, policy=FP32_ADAM, precision="fp32")
    strategies = planner.pricing.sharding(2, 8, True, False).strategies
    costs = planner.pricing.segment_costs(2, 8, sequence_parallel=True, folded=False)
    fused = segment_counts(graph, costs, strategies)
    unfused = segment_counts(graph, costs, strategies, unfused_attention=True)
    assert unfused["layers.0"].num_dispatches > fused["layers.0"].num_dispatches + 20
    assert unfused["layers.0"].num_dtensor_dispatches > fused["layers.0"].num_dtensor_dispatches + 20
    assert planner.pricing.counts(2, 8)["layers.0"] == unfused["layers.0"]

"""solver/costing.py: ops priced as the runtime runs them on the cluster's devices."""

from dataclasses import replace

from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.models import build_model
from autopar.plans.planning import capture_for_planning
from autopar.solver.sharding import cost_context
from autopar.solver.search import Planner
from cost_model.memory import FP32_ADAM


def test_attention_on_cpu_under_tensor_parallelism_is_priced_as_the_math_kernel():
    """On CPU the runtime runs attention on DTensors (tp > 1) through torch's math kernel
    (codegen's _cpu_attention): that path's kernels are priced there, the fused kernel elsewhere
    (without tp on CPU, and on GPUs)."""
    bundle = build_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=32,vocab=64", device="meta", batch_size=8)
    graph = capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets)
    cpu = Cluster.from_spec("cpu:procs=4")
    planner = Planner(graph, cpu, global_batch=8, policy=FP32_ADAM, precision="fp32")
    strategies = planner.pricing.sharding(2, 8, True, False).strategies
    node = next(node for node in graph.nodes if node.target == "aten.scaled_dot_product_attention.default")
    inputs = [graph.by_name[name].outputs[0] for name in node.inputs]

    def context(cluster: Cluster, tp: int):
        return cost_context(Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=cluster.devices_per_node), cluster)

    def priced(ctx) -> float:
        forward, backward = ctx.node_compute(node, strategies[node.name], inputs)
        return forward.total_s + backward.total_s

    def kernels_s(ctx, forward, backward) -> float:
        divisor = strategies[node.name].work_divisor(ctx.mesh.shape)
        scale = ctx._bytes_scale(node, strategies[node.name], inputs)
        return sum(ctx.compute.kernels(kernels, flops_scale=1.0 / divisor, bytes_scale=scale).total_s
                   for kernels in (forward, backward))

    math = context(cpu, 2)
    assert math.math_attention and node.unfused_fwd_kernels and node.unfused_bwd_kernels
    assert priced(math) == kernels_s(math, node.unfused_fwd_kernels, node.unfused_bwd_kernels)
    fused = replace(math, math_attention=False, _compute_cache={})
    assert priced(fused) == kernels_s(fused, node.fwd_kernels, node.bwd_kernels) != priced(math)
    assert not context(cpu, 1).math_attention
    assert not context(Cluster.from_spec("dgx-h100:nodes=1"), 2).math_attention


def test_a_collective_on_a_dim_other_than_0_copies_its_tensor_into_place():
    """NCCL gathers and scatters dim 0: torch's functional collectives put a sequence-sharded
    (batch, seq, hidden) tensor's chunks in place with a copy (a read and a write) after an
    all-gather and before a reduce-scatter; since torch 2025-12 the all-gather of a batch of one is
    a view. Megatron's (seq, batch, hidden) layout gathers dim 0: no copy."""
    from autopar.graph import TensorMeta

    cluster = Cluster.from_spec("dgx-h100:nodes=1")
    mesh = Mesh(axis_names=("tp",), shape=(4,), devices_per_node=8)
    ctx = cost_context(mesh, cluster)
    copy_s = lambda meta: 2 * meta.nbytes / ctx.compute.bandwidth_bytes_per_s + ctx.compute.overhead_s  # noqa: E731
    batched = TensorMeta(shape=(4, 2048, 1024), dtype="bfloat16")
    single = TensorMeta(shape=(1, 2048, 1024), dtype="bfloat16")

    def copies(context, meta, source, target):
        return [(event.op, event.copy_s) for event in context.redistribute(meta, source, target, "fwd")]

    assert copies(ctx, batched, ("S1",), ("R",)) == [("all_gather", copy_s(batched))]
    assert copies(ctx, single, ("S1",), ("R",)) == [("all_gather", 0.0)]  # a view
    assert copies(ctx, single, ("P",), ("S1",)) == [("reduce_scatter", copy_s(single))]
    assert copies(ctx, batched, ("S0",), ("R",)) == [("all_gather", 0.0)]  # dim 0: in place
    event = ctx.redistribute(batched, ("S1",), ("R",), "fwd")[0]
    assert event.time_s == ctx.comm.time_s("all_gather", batched.nbytes, mesh.group(0)) + event.copy_s
    before = replace(ctx, policy=replace(ctx.policy, sp_layout_copies="all"), _redistribute_cache={})
    assert copies(before, single, ("S1",), ("R",)) == [("all_gather", copy_s(single))]
    megatron = replace(ctx, policy=replace(ctx.policy, sp_layout_copies="none"), _redistribute_cache={})
    assert copies(megatron, batched, ("S1",), ("R",)) == [("all_gather", 0.0)]

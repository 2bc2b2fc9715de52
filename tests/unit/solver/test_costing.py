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

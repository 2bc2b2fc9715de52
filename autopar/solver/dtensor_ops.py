"""Which ops of a tensor-parallel plan the runtime dispatches through DTensor.

autopar's runtime runs an op on plain local tensors where the plan's placements make it purely
local (codegen/local_runs.py): every input and the output replicated, or a shard-local op (a
pointwise op, a view, a softmax or batched matmul) on shards; each of those pays eager dispatch
only. The rest (ops meeting a partial operand, matmuls that shard their weight, attention, views
of parameters and ops passing their gradient through to one, matmuls whose weight gradient is
fused into the GEMM) dispatch through DTensor, which costs per aten op they dispatch (the probe's
count, OpNode.dispatches) what the calibration's `framework.dtensor_dispatch` term prices
(overheads.py).
Local runs apply only to segments run without recomputation: a recomputing stage dispatches
every op through DTensor.

The rule mirrors codegen's from the plan alone (no torch here): the same placements, the target
names of the op families that codegen admits on shards, and whether an op reads a parameter.
"""

from __future__ import annotations

from autopar.graph import OpGraph, OpNode
from autopar.strategies import Strategy
from autopar.strategies.pointwise import CASTS, NONLINEAR_NARY, NONLINEAR_UNARY
from autopar.strategies.reduction import ALONG_DIM
from autopar.strategies.views import IDENTITIES, RESHAPES

_SDPA = "aten.scaled_dot_product_attention.default"
MATMULS = frozenset({"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.matmul.default",
                     "aten.bmm.default", "aten.baddbmm.default", "aten.einsum.default"})
PARAMETER_READERS = frozenset({
    *MATMULS, "aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default",
    "aten.group_norm.default", "aten.embedding.default", "aten.conv1d.default", "aten.conv2d.default",
    "aten.conv3d.default", "aten.convolution.default", "aten.mul.Tensor",
})
"""Ops that may read parameters on their local tensors: each computes the parameter's gradient
afresh. An op passing its output's gradient through to a parameter (an add of a position
embedding, a cast, a clone) may not: autograd would keep that very tensor as the parameter's
.grad behind a new DTensor and add the next microbatch's into it in place while another input's
backward still reads it (found on ViT under pp2 x tp2); views would alias the parameter."""
_SHARD_LOCAL = frozenset({
    *NONLINEAR_UNARY, *NONLINEAR_NARY, *CASTS, *RESHAPES, *IDENTITIES, *ALONG_DIM,
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor",
    "aten.div.Scalar", "aten.neg.default", "aten.unflatten.int", "aten.flatten.using_ints", "aten.transpose.int",
    "aten.permute.default", "aten.t.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.clone.default",
    "aten.expand.default", "aten.dropout.default", "aten.matmul.default", "aten.bmm.default", "aten.where.self",
})
"""Targets whose local run on shards gives the output's shard (codegen/local_runs.py's
pointwise ops, _SHARD_LOCAL and softmax along a whole dim)."""


def runs_on_dtensors(graph: OpGraph, node: OpNode, strategy: Strategy | None, *, fused_wgrad: bool) -> bool:
    """Whether the runtime dispatches `node` through DTensor under `strategy` (its first mesh
    axis: tensor parallelism); `fused_wgrad`: the runtime fuses weight gradients into the GEMMs
    of matmuls that read parameters (codegen/fused_wgrad.py)."""
    if strategy is None or len(node.outputs) != 1 or node.target == _SDPA or strategy.collectives:
        return True
    output = strategy.output[0]
    inputs = [placement[0] for placement in strategy.inputs]
    if not local_placement(output) or not all(local_placement(item) for item in inputs):
        return True
    reads_parameters = any(graph.by_name[name].kind == "param" for name in node.inputs if name in graph.by_name)
    if reads_parameters and (node.target not in PARAMETER_READERS or (fused_wgrad and node.target in MATMULS)):
        return True
    if output == "R":
        return not all(item == "R" for item in inputs)
    if node.target not in _SHARD_LOCAL or not any(item.startswith("S") for item in inputs):
        return True
    # A replicated input needing a gradient would get a partial one on each rank.
    return any(item == "R" and graph.by_name[name].requires_grad
               for item, name in zip(inputs, node.inputs) if name in graph.by_name)


def runs_math_attention(device_kind: str, tp: int) -> bool:
    """Whether the runtime runs attention through torch's math kernel (codegen's `_cpu_attention`):
    on CPU DTensors, which tensor parallelism makes (its ops and kernels: OpNode.unfused_*)."""
    return device_kind == "cpu" and tp > 1


def local_placement(placement: str | None) -> bool:
    """A placement whose tensor a rank holds whole or as its shard (not partial, not unplanned)."""
    return placement is not None and (placement == "R" or placement.startswith("S"))

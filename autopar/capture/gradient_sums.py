"""The additions autograd runs where one tensor feeds several differentiable uses.

Each op is probed alone (probe.py), so its recorded backward computes the gradients of its own
inputs and nothing more. When a tensor is read by k uses that need its gradient (a residual
stream read by a norm and by the residual add; a normalized input read by the q, k and v
projections; `x * x`), autograd's engine receives k gradients for it and sums them in its input
buffer before the producer's backward runs: k - 1 element-wise additions of the tensor's size
(`add_` in place when it can reuse the first buffer, `add` otherwise; each reads two and writes
one). Eager PyTorch runs them as separate kernels; on one H200 they are most of the `add` time
of a Llama step (BENCHMARKS "One GPU").

`with_gradient_sums` appends those additions to the backward kernels of the tensor's producer,
which is where they run and whose sharding the summed gradient has (a DTensor gradient is
redistributed back to its producer's placement before the engine adds it). Where the uses are
in another segment than the producer (the residual stream entering the next block), the sums
go to the second and later uses instead: a pipeline stage sums the gradient of its input before
sending it back, and every block then carries the sums of its own input, so identical blocks
stay identical (solver/quotient.py prices one for all). A weight read by several ops (a tied
embedding and head) has no priced producer: its sums go to its second and later readers too.
A use counts when it is an op whose output needs a gradient reading a
floating-point tensor that needs one; a `getitem` is not a use (it picks one output of a
multi-output op: the uses of what it picks are).

Apply it to a whole model's graph: the uses of a block's output are in the next block, so a
graph of a few traced blocks (block_reuse.py) gets its sums after it is expanded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from autopar.graph import Kernel, OpGraph, OpNode

GRADIENT_SUM_KERNEL = "aten.add.Tensor"
"""The name the additions are priced and reported under (autograd's input-buffer sum)."""


def with_gradient_sums(graph: OpGraph) -> OpGraph:
    """`graph` with one addition per differentiable use of a tensor beyond its first."""
    segment_of = {name: segment.name for segment in graph.segments for name in segment.nodes}
    uses: Counter = Counter()
    extra: dict[str, list[Kernel]] = {}
    for node in graph.nodes:
        if node.kind != "call" or node.target == "getitem" or not node.requires_grad:
            continue
        for source in node.inputs:
            producer = graph.by_name.get(source)
            if producer is None or not _needs_gradient(producer):
                continue
            uses[source] += 1
            if uses[source] > 1:
                same_segment = producer.kind == "call" and segment_of.get(source) == segment_of.get(node.name)
                extra.setdefault(source if same_segment else node.name, []).append(_sum_kernel(producer))
    if not extra:
        return graph
    nodes = tuple(replace(node, bwd_kernels=node.bwd_kernels + tuple(extra[node.name])) if node.name in extra else node
                  for node in graph.nodes)
    return replace(graph, nodes=nodes)


def _needs_gradient(node: OpNode) -> bool:
    return node.requires_grad and bool(node.outputs) and node.output.is_float


def _sum_kernel(producer: OpNode) -> Kernel:
    meta = producer.output
    return Kernel(name=GRADIENT_SUM_KERNEL, flops=float(meta.numel), io_bytes=3.0 * meta.nbytes, is_matmul=False,
                  dtype=meta.dtype)

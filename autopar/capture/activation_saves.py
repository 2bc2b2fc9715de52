"""Gated activations saved as their input: what SwiGLU and GeGLU keep for backward.

A gated MLP computes `act(x @ W_gate) * (x @ W_up)`. Eager PyTorch keeps four gate-sized tensors
for it: the activation's input (its own backward needs it), the activation's output and the up
projection (the product's backward), and the product (the down projection's). The activation's
output is a pointwise function of a tensor that is kept anyway, so autopar's runtime does what
Megatron-LM's fused `bias_swiglu` and Transformer Engine's GLU kernels do: the product saves a
recipe instead of the activation's output, and its backward runs the activation again on the
kept input (one pointwise kernel). Three of the four tensors stay.

The capture marks such products (`OpNode.recomputed_inputs`), so the cost model prices what the
runtime keeps and, where the product is not recomputed anyway, the activation run again in
backward (`SegmentCost.activation_recompute`); `autopar/codegen/recompute.py` (`compact_saves`)
does it at run time for the activations `OpGraph.recomputed_activations` names.

Only an activation whose one consumer is the product is folded: its output is then needed by
nothing but that product's backward. Activations whose backward keeps their output (sigmoid,
tanh, relu) save nothing by this and are left alone, as is an activation feeding a matmul
(GPT's GeLU MLP), which Megatron-LM also keeps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from autopar.graph import OpNode

RECOMPUTED_ACTIVATIONS = frozenset({"aten.silu.default", "aten.gelu.default"})
"""Activations whose backward keeps only their input, so their output can be run again from it."""
GATING_PRODUCTS = frozenset({"aten.mul.Tensor"})
"""The elementwise product that gates a linear unit."""


def fold_activation_saves(nodes: list[OpNode] | tuple[OpNode, ...]) -> list[OpNode]:
    """`nodes` with each gating product saving its activation operand as a recipe (see above)."""
    uses = Counter(source for node in nodes for source in node.inputs)
    by_name = {node.name: node for node in nodes}
    folded = []
    for node in nodes:
        if node.kind == "call" and node.target in GATING_PRODUCTS:
            indices = tuple(index for index in node.saved_inputs
                            if _foldable(by_name.get(node.inputs[index]), uses))
            if indices:
                node = replace(node, saved_inputs=tuple(i for i in node.saved_inputs if i not in indices),
                               recomputed_inputs=indices)
        folded.append(node)
    return folded


def _foldable(producer: OpNode | None, uses: Counter) -> bool:
    return (producer is not None and producer.kind == "call" and producer.target in RECOMPUTED_ACTIVATIONS
            and len(producer.inputs) == 1 and producer.saved_inputs == (0,) and not producer.saved_output
            and uses[producer.name] == 1)


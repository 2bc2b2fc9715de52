"""Each op's backward probed with its gradient laid out as its consumers' backward hands it over.

probe.py runs an op's backward with a gradient laid out like the op's output. Autograd hands an
op the gradient its consumer's backward returned, which can be laid out otherwise: in eager
attention, `(q * scale) @ k^T` copies q into a contiguous (batch x heads, seq, head_dim) operand,
so q's gradient arrives contiguous in (batch, heads, seq, head_dim) while q itself is a
transposed view of the projection's (batch, seq, hidden) output. The transpose's backward passes
that layout on, and the backward of the view that split the hidden dim (`grad.reshape(...)`)
then has to copy it: one copy of q's, k's, v's and the context's size per layer that no op's
own probe shows (BENCHMARKS "One GPU": the strided copies of an eager-attention GPT step).

`with_gradient_layouts` walks the captured ops from the loss back to the inputs; where the
gradient an op receives (the layout its consumers' probes returned for it, when they agree) is
not the layout it was probed with, its backward is probed again with that gradient, and the
layouts it returns go on to its producers. The copies this finds are autograd's (a composite
op such as `linear` reshapes its gradient like any view); a copy a GPU library makes inside a
kernel does not show on meta, on either probe. Captures by torch.export only: the
symbolic_trace fallback (capture_fx.py) keeps each op's first probe.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from autopar.graph import OpNode
from autopar.capture.probe import ProbeResult

Reprobe = Callable[[str, tuple[tuple[int, ...], ...]], ProbeResult | None]
"""Probes node `name` again with its gradients laid out with the given strides (None: cannot)."""


def with_gradient_layouts(nodes: list[OpNode], results: dict[str, ProbeResult], reprobe: Reprobe) -> list[OpNode]:
    """`nodes` with the backward kernels of ops whose gradient arrives in another layout re-probed;
    `results` (node name -> its probe) is updated in place."""
    consumers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for node in nodes:
        for slot, source in enumerate(node.inputs):
            consumers[source].append((node.name, slot))
    updated: dict[str, ProbeResult] = {}
    for node in reversed(nodes):
        result = results.get(node.name)
        if result is None or not node.requires_grad or len(result.output_strides) != 1:
            continue
        incoming = _incoming_layout(consumers.get(node.name, ()), results)
        if incoming is None or incoming == result.output_strides[0]:
            continue
        again = reprobe(node.name, (incoming,))
        if again is not None:
            results[node.name] = updated[node.name] = again
    return [replace(node, bwd_kernels=updated[node.name].bwd_kernels) if node.name in updated else node
            for node in nodes]


def _incoming_layout(uses: list[tuple[str, int]], results: dict[str, ProbeResult]) -> tuple[int, ...] | None:
    """The strides of the gradient a tensor receives: what its uses' backward returned for it, if
    they all agree (a sum of differently laid-out gradients, or a use not probed: unknown)."""
    layouts = set()
    for consumer, slot in uses:
        result = results.get(consumer)
        if result is None or slot >= len(result.input_grad_strides):
            return None
        if (strides := result.input_grad_strides[slot]) is not None:
            layouts.add(strides)
    return layouts.pop() if len(layouts) == 1 else None

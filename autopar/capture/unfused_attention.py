"""The aten ops torch's math attention kernel dispatches in place of a fused one.

DTensor has no sharding rule for the CPU flash kernel, so autopar's runtime runs attention on
CPU DTensors through torch's math kernel with an explicit causal mask
(codegen/interpreter.py's `_cpu_attention`): the scores as batched matmuls, the mask, a softmax and
their backward, each an op DTensor dispatches. The probe prices the fused kernel a GPU runs; this
counts the ops of the math path on the same meta inputs (OpNode.unfused_dispatches), which the
calibrated DTensor term prices where the runtime takes it (solver/overheads.py).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DispatchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def math_attention_dispatches(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False) -> int:
    """aten ops of the math kernel's forward and backward for these (meta) inputs, as the
    runtime calls it: contiguous inputs, a causal mask made explicit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    needs_grad = [t for t in (query, key, value) if isinstance(t, torch.Tensor) and t.requires_grad]
    if is_causal:  # made on plain tensors, then wrapped: not dispatched through DTensor
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    with torch.enable_grad(), DispatchCounter() as counter, sdpa_kernel(SDPBackend.MATH):
        query, key, value = (t.contiguous() for t in (query, key, value))
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs_grad and outputs:
            torch.autograd.grad(outputs, needs_grad, [torch.empty_like(t) for t in outputs], allow_unused=True)
    return counter.count

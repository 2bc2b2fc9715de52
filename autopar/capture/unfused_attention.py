"""torch's math attention kernel, run in place of a fused one.

DTensor has no sharding rule for the CPU flash kernel, so autopar's runtime runs attention on
CPU DTensors through torch's math kernel with an explicit causal mask
(codegen/interpreter.py's `_cpu_attention`): the scores as batched matmuls, the mask, a softmax and
their backward, each an op DTensor dispatches and a kernel of its own. The probe prices the fused
kernel a GPU runs; it also runs this path on the same meta inputs under its kernel recorders, so
that the ops (OpNode.unfused_dispatches: the calibrated DTensor term, solver/overheads.py) and the
kernels (OpNode.unfused_fwd_kernels / unfused_bwd_kernels: their compute, solver/costing.py) are
priced where the runtime takes it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten


def run_math_attention(forward: contextlib.AbstractContextManager, backward: contextlib.AbstractContextManager,
                       query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False) -> None:
    """Run the math kernel's forward inside `forward` and its backward inside `backward` (two
    dispatch modes that record what runs) for these (meta) inputs, as the runtime calls it:
    contiguous inputs, a causal mask made explicit on plain tensors (not dispatched through
    DTensor, so outside both modes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    needs_grad = [t for t in (query, key, value) if isinstance(t, torch.Tensor) and t.requires_grad]
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        with forward:
            query, key, value = (t.contiguous() for t in (query, key, value))
            output = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs_grad and outputs:
            with backward:
                torch.autograd.grad(outputs, needs_grad, [torch.empty_like(t) for t in outputs], allow_unused=True)

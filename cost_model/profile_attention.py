"""`autopar profile` on a GPU: the fused attention sweep.

scaled_dot_product_attention in bf16 (head dim 128, 32 query heads over 8 key/value heads, as
Llama 3), causal and not, at several sequence lengths: forward, and forward + backward (the
backward is the difference). Rates are torch's FLOP count over time (the full s x s square, as
autopar/capture/attention_flops.py counts kernels), so the price of a kernel is its count over the rate
at its size: a causal kernel, which skips the masked half, shows a rate above a matmul's.
Measured on an H200 (torch 2.11), at seq 8192: causal 1233 / 940 TFLOP/s (forward / backward),
not causal 655 / 492, against 750-790 for a large square matmul: pricing attention as a matmul
of its count was 35% high for causal training and 25-35% low without a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cost_model.profile import AttentionPoint
from cost_model.profile_timing import interleaved_medians

_SEQUENCES = (1024, 2048, 4096, 8192, 16384)
_SEQUENCES_QUICK = (2048, 8192)
_HEADS, _KV_HEADS, _HEAD_DIM = 32, 8, 128


def measure_attention(timer, device: torch.device, options, deadline_s: float) -> tuple[AttentionPoint, ...]:
    """The sweep on a CUDA device (none on a CPU: attention there is priced by its FLOPs)."""
    if device.type != "cuda":
        return ()
    cases, keys = [], []
    for seq in _SEQUENCES_QUICK if options.quick else _SEQUENCES:
        query = torch.randn(1, _HEADS, seq, _HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
        key, value = (torch.randn(1, _KV_HEADS, seq, _HEAD_DIM, device=device, dtype=torch.bfloat16,
                                  requires_grad=True) for _ in range(2))
        grad = torch.randn_like(query)
        for causal in (True, False):
            def forward(q=query, k=key, v=value, causal=causal):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

            def both(q=query, k=key, v=value, g=grad, forward=forward):
                return torch.autograd.grad(forward(), (q, k, v), g)

            cases += [forward, both]
            keys.append((seq, causal))
    times = interleaved_medians(timer, cases, warmup=options.warmup, repeats=options.repeats,
                                min_sample_s=options.min_sample_s, deadline_s=deadline_s)
    points = []
    for index, (seq, causal) in enumerate(keys):
        forward_s, both_s = times[2 * index], times[2 * index + 1]
        pairs = float(_HEADS * seq * seq)
        forward_flops, backward_flops = 4.0 * pairs * _HEAD_DIM, 10.0 * pairs * _HEAD_DIM
        points.append(AttentionPoint(phase="forward", causal=causal, flops=forward_flops,
                                     achieved_flops_per_s=forward_flops / forward_s))
        points.append(AttentionPoint(phase="backward", causal=causal, flops=backward_flops,
                                     achieved_flops_per_s=backward_flops / max(both_s - forward_s, 0.1 * both_s)))
    return tuple(points)

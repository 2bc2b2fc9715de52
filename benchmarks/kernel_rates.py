"""Rates of the kernels the profile's sweeps do not cover, on a GPU: fused attention and dtype casts.

    python benchmarks/kernel_rates.py        # on a machine with CUDA; prints a markdown table

- Attention: `scaled_dot_product_attention` in bf16 (head dim 128, 32 query heads, 8 key/value
  heads as Llama 3 8B), causal and not, forward and forward + backward, at several sequence
  lengths. The rate is torch's FLOP count (the full s x s square, as autopar's probe counts it)
  over the time, so a causal kernel that skips the masked half shows above the matmul rate.
- Casts: `.to()` between fp32 and bf16 of a 1 Gi-element tensor, bytes read + written over time,
  beside a same-dtype `mul` (what the profile's bandwidth figure measures).
Each figure is the median of CUDA-event timings after warm-up.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F


def timed_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention_rows(batch: int = 2, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> list[str]:
    rows = ["| seq | causal | forward ms | fwd TFLOP/s (full count) | fwd+bwd ms | bwd TFLOP/s (full count) |",
            "|---:|---|---:|---:|---:|---:|"]
    for seq in (2048, 4096, 8192):
        q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        grad = torch.randn_like(q)
        pairs = batch * heads * seq * seq
        forward_flops, backward_flops = 4.0 * pairs * head_dim, 10.0 * pairs * head_dim
        for causal in (True, False):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
            both = lambda: torch.autograd.grad(fwd(), (q, k, v), grad)  # noqa: E731
            forward_ms, both_ms = timed_ms(fwd), timed_ms(both)
            backward_ms = both_ms - forward_ms
            rows.append(f"| {seq} | {causal} | {forward_ms:.3f} | {forward_flops / forward_ms / 1e9:.0f} | "
                        f"{both_ms:.3f} | {backward_flops / backward_ms / 1e9:.0f} |")
    return rows


def cast_rows(elements: int = 2**30) -> list[str]:
    rows = ["| kernel | ms | GB/s (read + written) |", "|---|---:|---:|"]
    x32 = torch.randn(elements, device="cuda")
    x16 = x32.to(torch.bfloat16)
    out32, out16 = torch.empty_like(x32), torch.empty_like(x16)
    cases = [("mul fp32 (the profile's stream)", lambda: torch.mul(x32, 2, out=out32), 8),
             ("copy_ fp32 -> bf16", lambda: out16.copy_(x32), 6),
             ("copy_ bf16 -> fp32", lambda: out32.copy_(x16), 6),
             (".to(bf16) new tensor", lambda: x32.to(torch.bfloat16), 6),
             (".float() new tensor", lambda: x16.float(), 6)]
    for name, fn, bytes_per_element in cases:
        ms = timed_ms(fn)
        rows.append(f"| {name} | {ms:.3f} | {bytes_per_element * elements / ms / 1e6:.0f} |")
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_rates.py needs a CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("\n".join(attention_rows()) + "\n\n" + "\n".join(cast_rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

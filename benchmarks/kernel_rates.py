"""Rates of the kernels the profile's sweeps do not cover, on a GPU: fused attention, dtype casts,
attention with dropout, float8 GEMMs, and RoPE eager against compiled.

    python benchmarks/kernel_rates.py        # on a machine with CUDA; prints markdown tables

- Attention: `scaled_dot_product_attention` in bf16 (head dim 128, 32 query heads, 8 key/value
  heads as Llama 3 8B), causal and not, forward and forward + backward, at several sequence
  lengths. The rate is torch's FLOP count (the full s x s square, as autopar's probe counts it)
  over the time, so a causal kernel that skips the masked half shows above the matmul rate.
- Casts: `.to()` between fp32 and bf16 of a 1 Gi-element tensor, bytes read + written over time,
  beside a same-dtype `mul` (what the profile's bandwidth figure measures).
- Dropout inside fused attention (cost_model/attention.py DROPOUT_SLOWDOWN, measured once at seq
  2048, head dim 128): causal SDPA with dropout 0.1 over the same call without, forward and
  backward, at head dims 64 and 128 and seq 2048 and 8192.
- float8 GEMMs (`torch._scaled_mm`, tensorwise scales, bf16 output) beside bf16 `mm`, each linear's
  three GEMMs (forward, input gradient, weight gradient, whose inner dim is the tokens), with fast
  accumulation and without (torchao and Transformer Engine run the backward's two without: split
  accumulation), at the linears of a Llama 3 8B layer (8192 tokens), of GPT-3 175B at tp 4 (2048)
  and of a Grok-1 expert at tp 4 (1024 rows): the fp8 rate the model assumes is the bf16 one times
  the datasheet ratio (cost_model/fp8.py), and the published FP8 runs whose gain over bf16 is priced
  high (GPT-3 175B, Grok-1: docs/accuracy.md) run the small-token shapes.
- RoPE as the built-in Llama runs it (autopar/models/llama.py apply_rotary: chunk, neg, cat, two
  muls with the float32 tables, add) eagerly and under torch.compile (one fused kernel, as
  Megatron-Core's fused RoPE), forward + backward (docs/accuracy.md "Known compensations").
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


def dropout_rows(batch: int = 2, heads: int = 32) -> list[str]:
    rows = ["| seq | head dim | forward ms (dropout 0 / 0.1) | forward slowdown | backward ms (0 / 0.1) | "
            "backward slowdown |", "|---:|---:|---:|---:|---:|---:|"]
    for seq in (2048, 8192):
        for head_dim in (64, 128):
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            times = []
            for p in (0.0, 0.1):
                fwd = lambda p=p: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # noqa: E731
                forward_ms = timed_ms(fwd)
                times.append((forward_ms, timed_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), grad)) - forward_ms))
            (f0, b0), (f1, b1) = times
            rows.append(f"| {seq} | {head_dim} | {f0:.3f} / {f1:.3f} | {f1 / f0:.2f} | {b0:.3f} / {b1:.3f} | "
                        f"{b1 / b0:.2f} |")
    return rows


FP8_LINEARS = (
    ("Llama 3 8B qkv", 8192, 4096, 6144), ("Llama 3 8B o", 8192, 4096, 4096),
    ("Llama 3 8B gate_up", 8192, 4096, 28672), ("Llama 3 8B down", 8192, 14336, 4096),
    ("GPT-3 175B tp4 qkv", 2048, 12288, 9216), ("GPT-3 175B tp4 proj", 2048, 3072, 12288),
    ("GPT-3 175B tp4 fc1", 2048, 12288, 12288), ("GPT-3 175B tp4 fc2", 2048, 12288, 12288),
    ("Grok-1 expert tp4 fc1", 1024, 6144, 16384), ("Grok-1 expert tp4 fc2", 1024, 8192, 6144),
)
"""(name, tokens, in features, out features) of the linears fp8_gemm_rows times."""


def linear_gemms(tokens: int, k: int, n: int) -> tuple[tuple[str, int, int, int], ...]:
    """A linear's three GEMMs as (pass, M, K, N), out[M, N] = A[M, K] B[K, N]: the forward, the input
    gradient and the weight gradient (its inner dim is the tokens)."""
    return (("forward", tokens, k, n), ("grad input", tokens, n, k), ("grad weight", n, tokens, k))


def fp8_gemm_rows() -> list[str]:
    rows = ["| linear | GEMM | M x K x N | bf16 TFLOP/s | fp8 fast accum | fp8 split accum | fp8 / bf16 (as run) |",
            "|---|---|---|---:|---:|---:|---:|"]
    one = torch.ones((), device="cuda")
    for name, tokens, k_in, n_out in FP8_LINEARS:
        for gemm, m, k, n in linear_gemms(tokens, k_in, n_out):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            tflops = 2.0 * m * k * n / 1e9
            bf16_ms = timed_ms(lambda: a @ b.t())
            fp8_ms = [timed_ms(lambda fast=fast: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16, use_fast_accum=fast))
                      for fast in (True, False)]
            as_run = fp8_ms[0] if gemm == "forward" else fp8_ms[1]
            rows.append(f"| {name} | {gemm} | {m} x {k} x {n} | {tflops / bf16_ms:.0f} | {tflops / fp8_ms[0]:.0f} | "
                        f"{tflops / fp8_ms[1]:.0f} | {bf16_ms / as_run:.2f} |")
    return rows


def rope_rows(batch: int = 2, seq: int = 8192, heads: int = 32, head_dim: int = 128) -> list[str]:
    from autopar.models.llama import apply_rotary

    x = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (torch.randn(seq, head_dim, device="cuda") for _ in range(2))
    grad = torch.randn_like(x)
    rows = [f"| RoPE of one {list(x.shape)} bf16 tensor | forward + backward ms | GB/s (x read and written, twice) |",
            "|---|---:|---:|"]
    for name, fn in (("eager (the built-in Llama)", apply_rotary), ("torch.compile (one fused kernel)",
                                                                     torch.compile(apply_rotary))):
        ms = timed_ms(lambda fn=fn: torch.autograd.grad(fn(x, cos, sin), x, grad))
        rows.append(f"| {name} | {ms:.3f} | {4 * x.numel() * 2 / ms / 1e6:.0f} |")
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_rates.py needs a CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for table in (attention_rows, cast_rows, dropout_rows, fp8_gemm_rows, rope_rows):
        try:
            print("\n".join(table()) + "\n", flush=True)
        except Exception as error:  # one table's failure (no fp8 GEMMs before sm89) leaves the others
            print(f"{table.__name__}: {type(error).__name__}: {error}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

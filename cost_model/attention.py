"""Fused attention kernels priced from their documented rates (a device without a profile).

A measured profile prices scaled_dot_product_attention by its own sweep (profile_attention.py).
Without one, a device that names the attention kernel its runtime runs (DeviceSpec.attention_kernel)
prices each fused attention kernel at that kernel's published rate; one that names none prices it
as a matmul of torch's FLOP count (compute.py).

Counting. torch counts the whole s_q x s_k square, also under a causal mask
(autopar/capture/attention_flops.py); the kernels skip the masked tiles, and their published rates
count half the square under a causal mask (FlashAttention's benchmark convention, flops / 2 when
causal; the diagonal tiles they do compute are inside the rate). So

    time = counted FLOPs x work / (bf16 peak x efficiency(phase, mask) x f / (f + f_half))

with work = 1/2 under a causal mask (1 without), f = counted FLOPs x work and f_half the device's
matmul_half_efficiency_flops (small problems fill fewer SMs).

Rates, as fractions of the H100 SXM5's dense bf16 peak (989.4 TF/s), head dim 128, at long
sequences (the rates plateau from about 8k):
- FlashAttention-2, the four from one run of flash-attention's own Hopper benchmark
  (hopper/benchmark_attn.py, seq 8192, in Dao-AILab/flash-attention#1791, 2025-07): forward 369.9
  without a mask and 284.1 causal, backward 290.6 and 287.1. Shah et al., "FlashAttention-3"
  (arXiv 2407.08608, Figs. 5-6, seq 16k) chart FlashAttention-2 at 370 and 335 forward and 322
  backward without a mask (no causal backward): the same non-causal forward, a faster causal
  forward and backward. One run gives all four ratios the price needs; with the paper's three
  (and #1791's causal backward ratio) torchtitan's Llama 3 8B at 32k prices 8% faster
  (docs/accuracy.md).
- cuDNN (9.x, mid-2024), Shah et al. Figs. 5-6: forward 595 and 539 causal, backward 516; the
  causal backward, not charted, takes the forward's causal / no-mask ratio (an H200 here measured
  cuDNN's backward losing 2.6% to the causal mask at 16k against the forward's 5%,
  benchmarks/profiles/h200.json).
The backward's FLOPs are 2.5 x the forward's (five matmuls, the scores recomputed), as torch and
both sources count them.

Head dim. The rates above are at head dim 128. A kernel's rate falls with a smaller head dim (each
tile's matmuls are shorter against the same softmax work per score): Shah et al. chart both kernels
at head dim 64 too (Figs. 5-6, seq 16k): FlashAttention-2 forward 324 and 299 causal, backward 291;
cuDNN forward 413 and 388 causal, backward 433 (against 370/335/322 and 595/539/516 at 128). Each
kernel's rate at head dim 64 is its rate at 128 times that figure's ratio for the same kernel and
phase (the causal backward takes the backward's); between 64 and 128 the ratio is interpolated
linearly in the head dim; below 64 it is 64's (optimistic: nothing smaller is charted); above 128
it is 1 (both figures chart 256 forward only, at rates near 128's).

Dropout. A fused kernel with dropout draws a random number for every score it computes (Philox,
forward, and again in the backward to rebuild the mask), work the sweeps and the published rates
above do not have (none of them uses dropout). Measured here (one H200, torch 2.11's SDPA on
cuDNN, gpt3-1.3b: seq 2048, head dim 128, causal, dropout 0.1, batch 8;
benchmarks/gpu_runs/h200-2026-12-04/kernels-gpt3-1.3b-sdpa.txt against the same GPU's profile
sweep, benchmarks/profiles/h200.json): forward 13.14 ms against 6.81 ms priced without dropout,
backward 27.01 ms (the bprop kernel and its dO.O and dQ-conversion kernels) against 21.04: slowdowns of
1.93 and 1.28 (DROPOUT_SLOWDOWN), applied to any fused kernel with dropout on any GPU, also one
priced as a matmul of its count where the device names no kernel (compute.py; one measured
shape: the random numbers per score are fixed work, so a smaller head dim would lose more).

Which kernel runs is the runtime's: torch's SDPA runs its flash backend (FlashAttention-2) on
Hopper until it prefers cuDNN (pytorch#138522 made cuDNN opt-in after 2.5; sdp_utils'
check_prefer_cudnn_attention puts it first on sm90 from a bundled cuDNN above 9.15, torch 2.11);
Transformer Engine (Megatron-Core, NeMo) selects its cuDNN FusedAttention over FlashAttention on
Hopper ("Disabling FlashAttention to give FusedAttention preference on Hopper+").

This module does not import autopar or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

H100_SXM_BF16_TFLOPS = 989.4
"""The peak the published rates are fractions of."""
DROPOUT_SLOWDOWN = {"forward": 13.14 / 6.81, "backward": 27.01 / 21.04}
"""Time with dropout over time without, per phase, of a fused attention kernel (module docstring)."""


def dropout_slowdown(phase: str, dropout: bool) -> float:
    """What dropout multiplies a fused attention kernel's time by ("forward" or "backward")."""
    return DROPOUT_SLOWDOWN[phase] if dropout else 1.0


@dataclass(frozen=True, kw_only=True)
class AttentionKernel:
    """A fused attention kernel's long-sequence rates as fractions of the dense bf16 peak."""

    name: str
    """e.g. "flash2" (FlashAttention-2: torch SDPA's flash backend), "cudnn"."""
    forward: float
    """Forward without a mask."""
    forward_causal: float
    """Forward under a causal mask (FLOPs counted over the unmasked half)."""
    backward: float
    """Backward without a mask."""
    backward_causal: float
    """Backward under a causal mask."""
    head_dim_64: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Rate at head dim 64 over the rate at 128, forward, causal forward and backward (the causal
    backward takes the backward's), from one source charting both head dims."""
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("forward", "forward_causal", "backward", "backward_causal"):
            if not 0.0 < getattr(self, field) <= 1.0:
                raise ValueError(f"attention kernel {self.name}: {field} must be in (0, 1], got {getattr(self, field)}")
        if len(self.head_dim_64) != 3 or not all(0.0 < ratio <= 1.0 for ratio in self.head_dim_64):
            raise ValueError(f"attention kernel {self.name}: head_dim_64 must be three ratios in (0, 1], got "
                             f"{self.head_dim_64}")

    def efficiency(self, phase: str, causal: bool, head_dim: int = 0) -> float:
        """Fraction of the bf16 peak for "forward" or "backward", with or without a causal mask, at
        `head_dim` (0: unknown, priced at 128)."""
        if phase == "forward":
            rate, ratio = (self.forward_causal, self.head_dim_64[1]) if causal else (self.forward, self.head_dim_64[0])
        elif phase == "backward":
            rate, ratio = (self.backward_causal if causal else self.backward), self.head_dim_64[2]
        else:
            raise ValueError(f"unknown attention phase '{phase}' (forward, backward)")
        return rate * head_dim_factor(ratio, head_dim)


def head_dim_factor(ratio_at_64: float, head_dim: int) -> float:
    """The rate at `head_dim` over the rate at 128, given the ratio at 64: linear in the head dim
    between 64 and 128, 64's below, 1 above (and for 0, unknown)."""
    if head_dim <= 0 or head_dim >= 128:
        return 1.0
    if head_dim <= 64:
        return ratio_at_64
    return ratio_at_64 + (1.0 - ratio_at_64) * (head_dim - 64) / 64


def work_fraction(causal: bool) -> float:
    """Of torch's count (the whole square), the FLOPs a kernel does and its rate counts."""
    return 0.5 if causal else 1.0


def _hopper(name: str, *, forward: float, forward_causal: float, backward: float, backward_causal: float,
            at_64: tuple[float, float, float], at_128: tuple[float, float, float], source: str) -> AttentionKernel:
    """A kernel from its published rates in TF/s on an H100 SXM5 at head dim 128, and one source's
    forward, causal forward and backward rates at head dims 64 (`at_64`) and 128 (`at_128`)."""
    peak = H100_SXM_BF16_TFLOPS
    return AttentionKernel(name=name, forward=forward / peak, forward_causal=forward_causal / peak,
                           backward=backward / peak, backward_causal=backward_causal / peak,
                           head_dim_64=tuple(low / high for low, high in zip(at_64, at_128)), source=source)


HOPPER_ATTENTION_KERNELS = (
    _hopper("flash2", forward=369.9, forward_causal=284.1, backward=290.6, backward_causal=287.1,
            at_64=(324.0, 299.0, 291.0), at_128=(370.0, 335.0, 322.0),
            source="FlashAttention-2; Dao-AILab/flash-attention#1791 hopper/benchmark_attn.py, H100, head dim 128, "
                   "seq 8192; head dim 64 by Shah et al. 2024 Figs. 5-6 (64 against 128)"),
    _hopper("cudnn", forward=595.0, forward_causal=539.0, backward=516.0, backward_causal=516.0 * 539.0 / 595.0,
            at_64=(413.0, 388.0, 433.0), at_128=(595.0, 539.0, 516.0),
            source="cuDNN 9 fused attention; Shah et al. 2024 (arXiv 2407.08608) Figs. 5-6: H100 SXM5, head dim "
                   "128, seq 16k; causal backward at the forward's causal ratio; head dim 64 from the same figures"),
)
"""The kernels documented on Hopper (H100, H200: the same SMs and clocks)."""

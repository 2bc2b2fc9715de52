"""What `autopar profile` measures (ProfileOptions) and the default sweeps per device: plain data,
read by the profiler (profiler.py) and its collective phase (profile_collectives.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cost_model.errors import CostModelInputError
from cost_model.profile import COLLECTIVE_OPS

KIB, MIB = 2**10, 2**20
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = "fp8"
"""torch._scaled_mm on float8_e4m3fn operands (bf16 out), measured on GPUs with FP8 tensor cores, with
split accumulation (use_fast_accum off: partial sums promoted to fp32 at intervals), as torchao's and
Transformer Engine's float8 linears run their two backward matmuls."""
FP8_FAST = "fp8_fast"
"""The same with fast accumulation (use_fast_accum on), as both run the forward matmul."""
FP8_DTYPES = (FP8, FP8_FAST)
MATMUL_DTYPES = (*TORCH_DTYPES, *FP8_DTYPES)

# Default sweeps. CPU matmuls step by ~sqrt(2) in size (2.8x in FLOPs) so that log-linear
# interpolation between points stays within the curve's wiggles (cache-blocking steps).
_CPU_MATMUL_SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
_CPU_MATMUL_SIZES_QUICK = (64, 128, 256, 512, 1024)
_CUDA_MATMUL_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)
_CUDA_MATMUL_SIZES_QUICK = (256, 1024, 4096)
_CPU_MESSAGES = tuple(4 * KIB * 4**step for step in range(8))  # 4 KiB .. 64 MiB
_CPU_MESSAGES_QUICK = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB)
_CUDA_MESSAGES = tuple(4 * KIB * 4**step for step in range(10))  # 4 KiB .. 1 GiB
_CUDA_MESSAGES_QUICK = (64 * KIB, 4 * MIB, 64 * MIB)


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What `run_profile` measures; None fields take the device's defaults (see module)."""

    device: str = "cpu"
    """"cpu" or "cuda"."""
    num_processes: int = 1
    """Processes (devices) to measure collectives on; 1 measures compute only."""
    quick: bool = False
    """A smaller sweep with fewer repeats (tests, smoke runs): ~10 s on a laptop CPU."""
    matmul_sizes: tuple[int, ...] | None = None
    """Square matmul sizes m = n = k; default 64..2048 on CPU, 256..16384 on CUDA."""
    matmul_dtypes: tuple[str, ...] | None = None
    """dtype keys ("fp32", "bf16", "fp16"); default fp32 (+ bf16 unless very slow) on CPU,
    bf16, fp16 and fp32 on CUDA."""
    message_sizes_bytes: tuple[int, ...] | None = None
    """Collective message sizes; default 4 KiB..64 MiB on CPU, 4 KiB..1 GiB on CUDA."""
    collective_ops: tuple[str, ...] = COLLECTIVE_OPS
    """Collectives to measure."""
    warmup: int = 2
    """Untimed calls before a measurement."""
    repeats: int | None = None
    """Timed samples (interleaved rounds) per point; default 9, quick 3."""
    min_sample_s: float | None = None
    """Each sample repeats the op until it lasts this long; default 20 ms, quick 5 ms."""
    time_budget_s: float | None = None
    """Wall-clock budget; rounds stop early (keeping 3) once spent. Default 90 s, quick 12 s."""
    clock: str = "wall"
    """"wall" (time.perf_counter) or "cpu": compute timed by the thread's CPU time, which leaves
    out other jobs on a shared machine (CPU with one thread per process only; see Timer).
    Collectives are timed by the wall clock either way."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise CostModelInputError(f"profile: device must be 'cpu' or 'cuda', got {self.device!r}")
        if isinstance(self.num_processes, bool) or not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise CostModelInputError(f"profile: num_processes must be an integer >= 1, got {self.num_processes!r}")
        for dtype in self.matmul_dtypes or ():
            if dtype not in MATMUL_DTYPES:
                raise CostModelInputError(f"profile: unknown matmul dtype {dtype!r}; use {', '.join(MATMUL_DTYPES)}")
            if dtype in FP8_DTYPES and self.device == "cpu":
                raise CostModelInputError(f"profile: {dtype} matmuls are measured with torch._scaled_mm on GPUs with "
                                          "FP8 tensor cores; on CPUs float8 is emulated (priced at the bf16 rate): "
                                          f"drop {dtype}")
        for op in self.collective_ops:
            if op not in COLLECTIVE_OPS:
                raise CostModelInputError(f"profile: unknown collective {op!r}; use {', '.join(COLLECTIVE_OPS)}")
        for name in ("matmul_sizes", "message_sizes_bytes"):
            if any(size < 1 for size in getattr(self, name) or ()):
                raise CostModelInputError(f"profile: {name} must be positive, got {getattr(self, name)}")
        if self.clock not in ("wall", "cpu"):
            raise CostModelInputError(f"profile: clock must be 'wall' or 'cpu', got {self.clock!r}")
        if self.warmup < 0 or (self.repeats is not None and self.repeats < 1):
            raise CostModelInputError("profile: warmup must be >= 0 and repeats >= 1")

    def resolved(self) -> "ProfileOptions":
        """The options with every default filled in for the device and mode."""
        on_cpu, quick = self.device == "cpu", self.quick
        sizes = (_CPU_MATMUL_SIZES_QUICK if quick else _CPU_MATMUL_SIZES) if on_cpu else (
            _CUDA_MATMUL_SIZES_QUICK if quick else _CUDA_MATMUL_SIZES)
        messages = (_CPU_MESSAGES_QUICK if quick else _CPU_MESSAGES) if on_cpu else (
            _CUDA_MESSAGES_QUICK if quick else _CUDA_MESSAGES)
        return replace(
            self,
            matmul_sizes=tuple(sorted(set(self.matmul_sizes or sizes))),
            # fp8: measured where the GPU has FP8 tensor cores (the profiler drops it elsewhere).
            matmul_dtypes=self.matmul_dtypes or (("fp32", "bf16") if on_cpu else ("bf16", "fp16", "fp32", *FP8_DTYPES)),
            message_sizes_bytes=tuple(sorted(set(self.message_sizes_bytes or messages))),
            repeats=self.repeats or (3 if quick else 9),
            min_sample_s=self.min_sample_s or (0.005 if quick else 0.02),
            time_budget_s=self.time_budget_s or (12.0 if quick else 90.0),
        )

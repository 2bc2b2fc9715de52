"""Compute time of kernels on one device: a roofline with a measured or default efficiency.

    time = max(flops / (peak(dtype) x matmul_efficiency(flops)), bytes / (bandwidth x memory_eff))
           + kernel_overhead                                    (matmul-class kernels)
    time = max(bytes / (bandwidth x memory_eff), elements / element_rate(kind)) + kernel_overhead
                                                                (element-wise kernels)

Without a profile, matmul efficiency saturates with size: eff(f) = eff_max x f / (f + f_half),
so a large GEMM runs near (not at) peak and a tiny one is overhead-bound. With a profile the
measured throughput is interpolated in log(FLOPs) for the kernel's dtype, and element-wise
kernels heavy in arithmetic (GELU, softmax, norms) meet their kind's measured element rate: on
a GPU that ceiling is far above bandwidth, on a CPU it is what bounds them. Fused attention
kernels (flash / efficient / cuDNN sdpa, forward and backward) meet the profile's measured
attention rate for their phase and mask, interpolated the same way; without one, the documented
rate of the attention kernel the device names (DeviceSpec.attention_kernel, attention.py), and
where it names none, a matmul's.

A grouped matmul (MoE experts: S rows sorted by expert x weight[E, K, N]) is E matmuls of about
S/E rows each, and each runs at the rate of its own size: `groups` (the experts on the device)
prices the kernel as that many matmuls of flops / groups, not as one [S, K] x [K, N] matmul; a
profile's grouped-matmul sweep (rate by FLOPs per expert) prices it where measured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cost_model.attention import dropout_slowdown, work_fraction
from cost_model.hardware import DeviceSpec
from cost_model.profile import HardwareProfile

# torch dtype names -> the keys of DeviceSpec.peak_flops_per_s
_DTYPE_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp32",
               "bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "tf32": "tf32", "fp8": "fp8", "fp8_fast": "fp8_fast"}
_UNMEASURED_AS = {"fp8_fast": "fp8"}
"""A dtype key priced as another where the profile did not measure it: float8 matmuls with fast
accumulation (a profile's "fp8_fast" sweep) at the float8 rate, and at its peak."""


class KernelLike(Protocol):
    name: str
    flops: float
    io_bytes: float
    is_matmul: bool
    dtype: str
    causal: bool


# Element-wise kernels whose arithmetic, not memory traffic, can bound them (on CPUs): their
# kind's measured element rate is a second ceiling. Names are aten overloads without "aten.".
_KERNEL_KINDS = {
    **{name: "transcendental" for name in ("gelu", "gelu_backward", "silu", "silu_backward", "tanh",
                                           "tanh_backward", "sigmoid", "sigmoid_backward", "exp", "log", "erf",
                                           "pow", "rsqrt", "sqrt", "sin", "cos")},
    **{name: "normalize" for name in ("_softmax", "_softmax_backward_data", "_log_softmax",
                                      "_log_softmax_backward_data", "native_layer_norm",
                                      "native_layer_norm_backward", "native_group_norm", "_fused_rms_norm")},
}


_WIDENING_BYTES_PER_ELEMENT = 5.5
"""A cast reading 2 bytes and writing 4 per element moves 6 (a same-width copy 4 or 8)."""


def kernel_kind(name: str, dtype: str = "", elements: float = 0.0, io_bytes: float = 0.0,
                broadcast: bool = False) -> str | None:
    """"transcendental", "normalize", "upcast", "broadcast" or None for an aten overload name like
    "aten.gelu.default". "upcast" is a cast from a 16-bit float to a wider type (`dtype` is the
    input's): GPUs run it at about half the bandwidth of a same-width stream (H200: 2.1 against
    4.2 TB/s read + written), so it has its own measured rate. "broadcast" is any other pointwise
    kernel with a broadcast operand (Kernel.broadcast): unvectorized on GPUs."""
    if name == "aten._to_copy.default" and dtype in ("bfloat16", "float16") and elements > 0 \
            and io_bytes >= _WIDENING_BYTES_PER_ELEMENT * elements:
        return "upcast"
    kind = _KERNEL_KINDS.get(name.removeprefix("aten.").split(".")[0])
    return kind or ("broadcast" if broadcast else None)


@dataclass(frozen=True, kw_only=True)
class ComputeTime:
    """Time of a list of kernels, split by what bounds them."""

    matmul_s: float = 0.0
    """Kernels on tensor cores (compute-bound part)."""
    memory_s: float = 0.0
    """Memory-bound kernels, and matmuls limited by bandwidth."""
    overhead_s: float = 0.0
    """Launch overhead."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.memory_s + self.overhead_s

    def __add__(self, other: "ComputeTime") -> "ComputeTime":
        return ComputeTime(matmul_s=self.matmul_s + other.matmul_s, memory_s=self.memory_s + other.memory_s,
                           overhead_s=self.overhead_s + other.overhead_s)

    def scaled(self, factor: float) -> "ComputeTime":
        return ComputeTime(matmul_s=self.matmul_s * factor, memory_s=self.memory_s * factor,
                           overhead_s=self.overhead_s * factor)


class ComputeModel:
    """Prices kernels on one kind of device."""

    def __init__(self, device: DeviceSpec, profile: HardwareProfile | None = None) -> None:
        self.device = device
        self.profile = profile
        if profile is not None:
            self.bandwidth_bytes_per_s = profile.memory_bandwidth_bytes_per_s
            self.overhead_s = profile.kernel_overhead_s
        else:
            self.bandwidth_bytes_per_s = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
            self.overhead_s = device.kernel_overhead_s
        self._tables = _matmul_tables(profile) if profile is not None else {}
        self.element_rates = {point.kind: point.elements_per_s for point in profile.elementwise} if profile else {}
        self._attention = _attention_tables(profile) if profile is not None else {}
        self._grouped = _grouped_tables(profile) if profile is not None else {}

    def measured(self, dtype: str) -> bool:
        """Whether the profile measured matmuls of this dtype key ("fp8": torch._scaled_mm)."""
        return _DTYPE_KEYS.get(dtype, dtype) in self._tables

    def measured_grouped(self, dtype: str) -> bool:
        """Whether the profile's grouped-matmul sweep measured this dtype key."""
        return _DTYPE_KEYS.get(dtype, dtype) in self._grouped

    def matmul_rate(self, flops: float, dtype: str) -> float:
        """Achieved FLOP/s of a matmul of `flops` FLOPs."""
        key = _DTYPE_KEYS.get(dtype, "fp32")
        if key not in self._tables:
            key = _UNMEASURED_AS.get(key, key)
        table = self._tables.get(key) or self._tables.get("fp32") or (next(iter(self._tables.values()), None))
        if table is not None:
            return _interpolate(table, flops)
        efficiency = self.device.matmul_efficiency * flops / (flops + self.device.matmul_half_efficiency_flops)
        return self.device.peak_flops(key) * max(efficiency, 1e-6)

    def documented_attention_s(self, flops: float, phase: str, causal: bool, head_dim: int = 0) -> float:
        """A fused attention kernel of torch's count `flops` at the device's named kernel's
        documented rate at its head dim (cost_model/attention.py; 0: unknown, 128's rate)."""
        work = flops * work_fraction(causal)
        efficiency = self.device.attention.efficiency(phase, causal, head_dim)
        efficiency *= work / (work + self.device.matmul_half_efficiency_flops)
        return work / (self.device.peak_flops("bf16") * efficiency)

    def grouped_matmul_s(self, flops: float, flops_per_group: float, dtype: str) -> float:
        """Tensor-core time of a grouped matmul of `flops` made of matmuls of `flops_per_group`
        each (one expert's rows x its weight): each runs at the rate of its own size, so many
        small experts run far below a single matmul of the same total."""
        if flops <= 0:
            return 0.0
        per_group = min(flops_per_group, flops)
        table = self._grouped.get(_DTYPE_KEYS.get(dtype, "fp32"))
        rate = _interpolate(table, per_group) if table is not None else self.matmul_rate(per_group, dtype)
        return flops / rate

    def kernel(self, flops: float, io_bytes: float, is_matmul: bool, dtype: str = "bfloat16",
               name: str = "", causal: bool = False, broadcast: bool = False, groups: int = 1,
               head_dim: int = 0, dropout: bool = False) -> ComputeTime:
        """`groups` > 1: a grouped matmul (is_grouped_matmul(name)) of that many equal matmuls;
        `head_dim`, `dropout`: a fused attention kernel's query head dim (0: unknown) and whether
        it drops out (cost_model/attention.py)."""
        memory_s = io_bytes / self.bandwidth_bytes_per_s
        phase = attention_phase(name)
        attention = self._attention.get((phase, causal)) if self._attention else None
        if attention is not None and flops > 0:
            return ComputeTime(matmul_s=flops / _interpolate(attention, flops) * dropout_slowdown(phase, dropout),
                               overhead_s=self.overhead_s)
        documented = self.device.attention if not self._attention else None
        if documented is not None and flops > 0 and phase:
            return ComputeTime(matmul_s=self.documented_attention_s(flops, phase, causal, head_dim)
                               * dropout_slowdown(phase, dropout), overhead_s=self.overhead_s)
        if not is_matmul or flops <= 0:
            rate = self.element_rates.get(kernel_kind(name, dtype, flops, io_bytes, broadcast)) if name else None
            if rate:  # flops of an element-wise kernel count its output elements
                memory_s = max(memory_s, flops / rate)
            return ComputeTime(memory_s=memory_s, overhead_s=self.overhead_s)
        matmul_s = self.grouped_matmul_s(flops, flops / groups, dtype) if groups > 1 else \
            flops / self.matmul_rate(flops, dtype)
        if phase:  # a fused attention kernel priced as a matmul of its count: its dropout too
            matmul_s *= dropout_slowdown(phase, dropout)
        if matmul_s >= memory_s:
            return ComputeTime(matmul_s=matmul_s, overhead_s=self.overhead_s)
        return ComputeTime(memory_s=memory_s, overhead_s=self.overhead_s)

    def kernels(self, kernels: Iterable[KernelLike], *, flops_scale: float = 1.0, bytes_scale: float = 1.0,
                groups: int = 1, causal: bool | None = None) -> ComputeTime:
        """Total time of kernels whose FLOPs and bytes are scaled (e.g. by 1/shards); the grouped
        matmuls among them (is_grouped_matmul) run `groups` matmuls each (the experts on this device);
        `causal` run them causal or not (a ring step's block), else each as captured."""
        total = ComputeTime()
        for kernel in kernels:
            total = total + self.kernel(kernel.flops * flops_scale, kernel.io_bytes * bytes_scale,
                                        kernel.is_matmul, kernel.dtype, kernel.name,
                                        getattr(kernel, "causal", False) if causal is None else causal,
                                        getattr(kernel, "broadcast", False),
                                        groups if is_grouped_matmul(kernel.name) else 1,
                                        getattr(kernel, "head_dim", 0), getattr(kernel, "dropout", False))
        return total


def is_grouped_matmul(name: str) -> bool:
    """A grouped expert matmul's kernel: torch's `_grouped_mm` (forward and both backward
    matmuls) or transformers' `grouped_mm_fallback` and its backward."""
    return "grouped_mm" in name


_ATTENTION_KERNELS = {f"aten._scaled_dot_product_{kind}_attention{suffix}.default": phase
                      for kind in ("flash", "efficient", "cudnn")
                      for suffix, phase in (("", "forward"), ("_backward", "backward"))}


def attention_phase(name: str) -> str | None:
    """"forward" or "backward" for a fused attention kernel's aten name, else None."""
    return _ATTENTION_KERNELS.get(name)


def _attention_tables(profile: HardwareProfile) -> dict[tuple[str, bool], tuple[list[float], list[float]]]:
    tables: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for point in profile.attention:
        tables.setdefault((point.phase, point.causal), []).append((math.log(point.flops), point.achieved_flops_per_s))
    return {key: (list(x for x, _ in sorted(points)), list(y for _, y in sorted(points)))
            for key, points in tables.items()}


def _grouped_tables(profile: HardwareProfile) -> dict[str, tuple[list[float], list[float]]]:
    """Measured grouped-matmul rates by log(FLOPs per expert), per dtype key."""
    tables: dict[str, list[tuple[float, float]]] = {}
    for point in profile.grouped_matmul:
        tables.setdefault(_DTYPE_KEYS.get(point.dtype, point.dtype), []).append(
            (math.log(point.flops_per_expert), point.achieved_flops_per_s))
    return {key: (list(x for x, _ in sorted(points)), list(y for _, y in sorted(points)))
            for key, points in tables.items()}


def _matmul_tables(profile: HardwareProfile) -> dict[str, tuple[list[float], list[float]]]:
    tables: dict[str, list[tuple[float, float]]] = {}
    for point in profile.matmul:
        tables.setdefault(_DTYPE_KEYS.get(point.dtype, point.dtype), []).append(
            (math.log(point.flops), point.achieved_flops_per_s))
    return {key: (list(x for x, _ in sorted(points)), list(y for _, y in sorted(points)))
            for key, points in tables.items()}


def _interpolate(table: tuple[list[float], list[float]], flops: float) -> float:
    """Achieved rate at `flops`: log-linear between measured sizes; above the largest, its rate;
    below the smallest, the smallest's time (small kernels are launch-bound)."""
    log_flops, rates = table
    x = math.log(max(flops, 1.0))
    if x >= log_flops[-1]:
        return rates[-1]
    if x <= log_flops[0]:
        return rates[0] * math.exp(x - log_flops[0])
    index = bisect.bisect_right(log_flops, x)
    x0, x1 = log_flops[index - 1], log_flops[index]
    y0, y1 = rates[index - 1], rates[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

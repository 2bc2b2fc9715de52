"""Device and link specifications, and the presets of common GPU systems.

Figures are datasheet values (dense, no sparsity). Link bandwidths are per device and per
direction: NVIDIA quotes NVLink "per GPU, both directions", which is twice what one device can
send. The efficiency defaults are what well-tuned kernels reach on these parts; a measured
profile (`autopar profile`) replaces them. Each GPU system also names its collective library's
protocol terms (`CollectiveSpec`: NCCL's tuning-model constants for its GPU generation and host
CPU), which make the achieved bandwidth depend on message size and group span (comm.py).

This module does not import autopar or torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from cost_model.attention import HOPPER_ATTENTION_KERNELS, AttentionKernel

GB = 1e9
GIB = 2**30
TFLOPS = 1e12

DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process) as the cost model sees it."""

    name: str
    """Human-readable name, e.g. "A100 SXM4 80GB"."""
    peak_flops_per_s: dict[str, float]
    """Dense peak FLOP/s per dtype key ("bf16", "fp16", "fp32", "tf32", "fp8"); "fp8" only where
    the device has FP8 tensor cores (torch._scaled_mm: compute capability 8.9 and up)."""
    memory_bytes: float
    """Device memory capacity in bytes (as the runtime reports it)."""
    memory_bandwidth_bytes_per_s: float
    """Peak device-memory bandwidth."""
    matmul_efficiency: float = 0.8
    """Fraction of peak that a large matmul reaches (small ones reach less, see compute.py)."""
    matmul_half_efficiency_flops: float = 2.0e9
    """Matmul size (FLOPs) at which half of `matmul_efficiency` is reached."""
    fp8_matmul_efficiency: float = 1.0
    """What float8 GEMMs reach of their (fp8) peak relative to what bf16 GEMMs of the same shape
    reach of theirs: the achieved float8/bf16 speed-up is the peaks' ratio times this. 1 where no
    measurement is documented (a profile's fp8 sweep measures it)."""
    memory_efficiency: float = 0.8
    """Fraction of the memory bandwidth that streaming (element-wise) kernels reach."""
    kernel_overhead_s: float = 5e-6
    """Fixed cost of one kernel launch."""
    host_link_bytes_per_s: float = 0.0
    """Device-host copy bandwidth per direction (the PCIe link to the CPU's memory); 0: unknown,
    and optimizer offload is not offered."""
    host_memory_bandwidth_bytes_per_s: float = 0.0
    """This device's share of the host's DRAM bandwidth (the CPU optimizer step of offload)."""
    host_memory_bytes: float = 0.0
    """This device's share of the host's memory (what offloaded states may use)."""
    board_power_w: float = 0.0
    """Board power (TDP) at which the peak figures hold; 0: unknown."""
    power_limit_w: float = 0.0
    """Power cap the operator set below the board power (`nvidia-smi --power-limit`); 0: none."""
    clock_power_exponent: float = 0.0
    """How the tensor clock follows a power cap: clock ~ power ** exponent, from two datasheet
    parts of one die at different board powers; 0: no documented relation (a cap cannot be priced)."""
    sm_count: int = 0
    """Streaming multiprocessors (the datasheet's SM count): what a collective's kernels take a
    share of while they run beside compute (cost_model/contention.py); 0: unknown, not priced."""
    attention_kernels: tuple[AttentionKernel, ...] = ()
    """Fused attention kernels whose rates are documented on this device (cost_model/attention.py)."""
    attention_kernel: str = ""
    """The fused attention kernel the runtime runs here, by name (one of attention_kernels): it then
    prices attention without a profile; "": not named, attention priced as a matmul of its FLOPs."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        _require_positive(self.name, "memory_bytes", self.memory_bytes)
        if self.attention_kernel and self.attention is None:
            known = ", ".join(kernel.name for kernel in self.attention_kernels) or "none documented"
            raise ValueError(f"{self.name}: attention_kernel '{self.attention_kernel}' has no documented rates on this "
                             f"device (known: {known}); profile the device (`autopar profile`) instead")
        for name in ("board_power_w", "power_limit_w", "clock_power_exponent"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{self.name}: {name} must be >= 0, got {getattr(self, name)}")
        if self.power_limit_w and not (self.board_power_w and self.clock_power_exponent):
            raise ValueError(f"{self.name}: power_limit_w {self.power_limit_w:g} W needs the device's board_power_w and "
                             "clock_power_exponent (no documented clock/power relation for it); set both, or set "
                             "the capped peak directly (bf16_tflops) or profile the device (`autopar profile`)")
        _require_positive(self.name, "memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        for dtype, flops in self.peak_flops_per_s.items():
            _require_positive(self.name, f"peak_flops_per_s[{dtype}]", flops)
        for name in ("matmul_efficiency", "memory_efficiency", "fp8_matmul_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got {value}")
        if self.kernel_overhead_s < 0:
            raise ValueError(f"{self.name}: kernel_overhead_s must be >= 0, got {self.kernel_overhead_s}")
        if self.sm_count < 0:
            raise ValueError(f"{self.name}: sm_count must be >= 0 (0: unknown), got {self.sm_count}")
        for name in ("host_link_bytes_per_s", "host_memory_bandwidth_bytes_per_s", "host_memory_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.name}: {name} must be >= 0, got {getattr(self, name)}")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype key at the device's power limit; fp32 matmuls use tf32 where the
        device has it."""
        if dtype in self.peak_flops_per_s:
            peak = self.peak_flops_per_s[dtype]
        elif dtype in ("fp16", "fp8") and "bf16" in self.peak_flops_per_s:  # fp8 without: emulated in bf16
            peak = self.peak_flops_per_s["bf16"]
        else:
            peak = self.peak_flops_per_s.get("fp32", min(self.peak_flops_per_s.values()))
        return peak * self.clock_fraction

    @property
    def attention(self) -> AttentionKernel | None:
        """The named attention kernel's documented rates (None: not named)."""
        return next((kernel for kernel in self.attention_kernels if kernel.name == self.attention_kernel), None)

    @property
    def fp8_matmul_speedup(self) -> float:
        """A float8 GEMM's speed over the same bf16 GEMM where no profile measured it: the peaks'
        ratio times fp8_matmul_efficiency (1 where the device emulates float8)."""
        if not self.runs_fp8_matmuls:
            return 1.0
        return self.peak_flops("fp8") / self.peak_flops("bf16") * self.fp8_matmul_efficiency

    @property
    def runs_fp8_matmuls(self) -> bool:
        """Float8 matmuls run on FP8 tensor cores at a peak above bf16's; else the pricing emulates
        them (dequantised, at the bf16 rate)."""
        return self.has_fp8 and self.peak_flops("fp8") > self.peak_flops("bf16")

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores (a float8 matmul runs at the "fp8" peak, not emulated)."""
        return "fp8" in self.peak_flops_per_s

    @property
    def clock_fraction(self) -> float:
        """Tensor clock under the power limit as a fraction of the clock the peak figures hold at
        (1 without a cap, or with one at or above the board power). Memory bandwidth does not move:
        the HBM clock is not scaled by the power cap."""
        if not self.power_limit_w or self.power_limit_w >= self.board_power_w:
            return 1.0
        return (self.power_limit_w / self.board_power_w) ** self.clock_power_exponent


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One level of the interconnect, seen from one device."""

    name: str
    """e.g. "NVLink3/NVSwitch" or "HDR InfiniBand"."""
    bandwidth_bytes_per_s: float
    """Per device, per direction."""
    latency_s: float
    """Per ring step of a large-message collective (the alpha of the alpha-beta model; on NCCL
    systems the Simple protocol's step, which the other protocols' steps are fractions of)."""
    efficiency: float = 0.85
    """Fraction of the bandwidth that large collectives reach (NCCL bus bandwidth / link rate)."""

    def __post_init__(self) -> None:
        _require_positive(self.name, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if self.latency_s < 0:
            raise ValueError(f"{self.name}: latency_s must be >= 0, got {self.latency_s}")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"{self.name}: efficiency must be in (0, 1], got {self.efficiency}")


INF = float("inf")


@dataclass(frozen=True, kw_only=True)
class ProtocolSpec:
    """One protocol of the collective library (NCCL's LL, LL128 or Simple), as its tuning model
    prices a ring: a launch latency, a latency per ring step on each link level, and a share of
    the link's large-message bus bandwidth."""

    name: str
    """e.g. "LL128"."""
    launch_latency_s: float
    """Fixed cost of one collective with this protocol (NCCL's ring base latency)."""
    intra_hop_fraction: float
    """Latency of one ring step inside a node, as a fraction of the intra-node link's `latency_s`
    (which is the Simple protocol's step)."""
    inter_hop_fraction: float
    """Latency of a ring step between nodes, when several devices of each node share the ring, as
    a fraction of the inter-node link's `latency_s`."""
    lone_inter_hop_fraction: float
    """Latency of a step between nodes when the group has one device per node (every step crosses
    the network and nothing overlaps it; NCCL prices it with its tree network latency)."""
    bandwidth_fraction: float
    """Share of the link's large-message bus bandwidth this protocol reaches (LL moves 8 data bytes
    per 16-byte line, LL128 120 of 128 bytes)."""
    max_bus_bandwidth_bytes_per_s: tuple[float, float, float] = (INF, INF, INF)
    """Cap on its bus bandwidth for groups on one node, two nodes, more nodes (NCCL caps LL by GPU
    generation inside a node and by host CPU across nodes)."""
    multi_node_all_reduce_latency_factor: float = 1.0
    """Multiplier on its latency in ring all-reduces that span nodes (NCCL's "plateau effect of
    ring" on Simple: 1.4 from Ampere on, 1.9 before)."""
    proxy_steps: float = 1.0
    """Network-proxy posts per ring step (NCCL: 3 for Simple, whose steps also flush): in a ring
    that spans nodes, even the intra-node steps take at least this x `proxy_overhead_s`."""
    across_nodes: bool = True
    """Whether the library uses this protocol for groups that span nodes."""

    def __post_init__(self) -> None:
        if self.launch_latency_s < 0:
            raise ValueError(f"protocol {self.name}: launch_latency_s must be >= 0, got {self.launch_latency_s}")
        if not self.multi_node_all_reduce_latency_factor >= 1.0:
            raise ValueError(f"protocol {self.name}: multi_node_all_reduce_latency_factor must be >= 1, "
                             f"got {self.multi_node_all_reduce_latency_factor}")
        for name in ("intra_hop_fraction", "inter_hop_fraction", "lone_inter_hop_fraction", "proxy_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"protocol {self.name}: {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.bandwidth_fraction <= 1.0:
            raise ValueError(f"protocol {self.name}: bandwidth_fraction must be in (0, 1], got {self.bandwidth_fraction}")
        if len(self.max_bus_bandwidth_bytes_per_s) != 3 or not all(c > 0 for c in self.max_bus_bandwidth_bytes_per_s):
            raise ValueError(f"protocol {self.name}: max_bus_bandwidth_bytes_per_s must be three positive caps "
                             f"(one node, two nodes, more), got {self.max_bus_bandwidth_bytes_per_s}")


@dataclass(frozen=True, kw_only=True)
class CollectiveSpec:
    """How the system's collective library runs: for each collective and message size it uses the
    fastest of its protocols (and, for all-reduce across nodes, of ring and tree), as NCCL's tuner
    does (cost_model/comm.py)."""

    library: str
    """e.g. "NCCL 2.2x"."""
    protocols: tuple[ProtocolSpec, ...]
    """The protocols it chooses among."""
    proxy_overhead_s: float
    """Cost of one network post by the proxy thread (NCCL: 1 us on Intel hosts, 2 us on AMD)."""
    tree_bandwidth_fraction: float = 0.92
    """Share of the ring's bus bandwidth a tree all-reduce reaches (NCCL's tree model)."""
    channels: int = 0
    """CUDA blocks a collective runs with (NCCL: one block per channel, each resident on one SM
    for the collective's whole duration); 0: unknown, their SM share is not priced."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        if not self.protocols:
            raise ValueError(f"{self.library}: a collective library needs at least one protocol")
        names = [protocol.name for protocol in self.protocols]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.library}: protocol names must be unique, got {names}")
        if not any(protocol.across_nodes for protocol in self.protocols):
            raise ValueError(f"{self.library}: at least one protocol must work across nodes")
        if self.proxy_overhead_s < 0:
            raise ValueError(f"{self.library}: proxy_overhead_s must be >= 0, got {self.proxy_overhead_s}")
        if self.channels < 0:
            raise ValueError(f"{self.library}: channels must be >= 0 (0: unknown), got {self.channels}")
        if not 0.0 < self.tree_bandwidth_fraction <= 1.0:
            raise ValueError(f"{self.library}: tree_bandwidth_fraction must be in (0, 1], "
                             f"got {self.tree_bandwidth_fraction}")


@dataclass(frozen=True, kw_only=True)
class SystemSpec:
    """A kind of node: its devices, its two link levels and its collective library."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    collectives: CollectiveSpec | None = None
    """NCCL's protocol terms on GPU systems; None: the plain alpha-beta model (gloo)."""
    description: str = ""
    source: str = ""


def _require_positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{owner}: {name} must be positive, got {value}")


# --- devices -------------------------------------------------------------------------------
# Sources: NVIDIA A100 datasheet (2021), H100 datasheet (2023), H200 product brief (2024),
# V100 datasheet (2018); see shared/reference/hardware.md. Memory capacity is what nvidia-smi
# reports (e.g. 81920 MiB on A100 80GB).
#
# Host terms (optimizer offload), per GPU of the system, from the system datasheets: the host
# link is the GPU's PCIe x16 link per direction (Gen3 15.75, Gen4 31.5, Gen5 63 GB/s); host
# memory bandwidth is the node's DRAM channels shared by its 8 GPUs (DGX A100: 2x EPYC 7742,
# 16 channels DDR4-3200 = 409.6 GB/s; DGX H100 / HGX H200: 2x Xeon 8480C, 16 channels
# DDR5-4800 = 614.4 GB/s; p3.16xlarge: 2x Xeon E5-2686 v4, 8 channels DDR4-2400 = 153.6 GB/s);
# host memory is the node's system memory shared by 8 GPUs (DGX A100 40GB 1 TB, 80GB 2 TB,
# DGX H100 2 TB, HGX H200 2 TB as built by most vendors, p3.16xlarge 488 GiB).
PCIE_GEN3_X16 = 15.75 * GB
PCIE_GEN4_X16 = 31.5 * GB
PCIE_GEN5_X16 = 63.0 * GB

A100_40G = DeviceSpec(
    name="A100 SXM4 40GB",
    peak_flops_per_s={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
    memory_bytes=40 * GIB,
    memory_bandwidth_bytes_per_s=1555 * GB,
    host_link_bytes_per_s=PCIE_GEN4_X16,
    host_memory_bandwidth_bytes_per_s=409.6 * GB / 8,
    host_memory_bytes=1024 * GIB / 8,
    board_power_w=400.0,
    sm_count=108,
    source="NVIDIA A100 Tensor Core GPU datasheet; DGX A100 datasheet (host)",
)
A100_80G = replace(
    A100_40G,
    name="A100 SXM4 80GB",
    memory_bytes=80 * GIB,
    memory_bandwidth_bytes_per_s=2039 * GB,
    host_memory_bytes=2048 * GIB / 8,
)
# Clock against board power on Hopper, from two datasheet parts of the same 132-SM GH100 die:
# H100 SXM5 989.4 dense bf16 TF/s at 700 W and H100 NVL 835.5 TF/s (1,671 with sparsity) at its
# 400 W maximum. The ratio of their peaks is the ratio of their tensor clocks (1830 vs 1545 MHz
# x 132 SMs x 4096 FLOP/clock), so clock ~ power ** (ln(989.4 / 835.5) / ln(700 / 400)) = ** 0.30
# between those powers (a cube-root law, as dynamic power ~ f V^2 with V ~ f predicts).
# Ampere has no such pair (A100 PCIe lists A100 SXM4's peak at 250-300 W): no exponent.
H100_SXM_BOARD_POWER_W, H100_NVL_BOARD_POWER_W = 700.0, 400.0
H100_SXM_BF16_TFLOPS, H100_NVL_BF16_TFLOPS = 989.4, 835.5
HOPPER_CLOCK_POWER_EXPONENT = (math.log(H100_SXM_BF16_TFLOPS / H100_NVL_BF16_TFLOPS)
                               / math.log(H100_SXM_BOARD_POWER_W / H100_NVL_BOARD_POWER_W))

H100_SXM = DeviceSpec(
    name="H100 SXM5 80GB",
    # Dense FP8 (e4m3/e5m2) is twice dense bf16 on Hopper: 1,979 TF/s on the datasheet.
    peak_flops_per_s={"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 495 * TFLOPS, "fp32": 67 * TFLOPS,
                      "fp8": 1979 * TFLOPS},
    memory_bytes=79.6 * GIB,
    memory_bandwidth_bytes_per_s=3350 * GB,
    # Large bf16 GEMMs on H100 reach a smaller fraction of the (higher) peak than on A100.
    matmul_efficiency=0.7,
    matmul_half_efficiency_flops=6.0e9,
    # Float8 GEMMs run 1.905x the bf16 ones, not the peaks' 2x: Transformer Engine's GEMM profiling
    # guide (docs/examples/gemm_profiling, 2026-05) timed a 5B model's 12 per-layer GEMMs (15,872
    # tokens, hidden 4,096, MLP 16,384) on an H200 NVL, pre-quantized: bf16 31.968 ms, FP8 (current
    # scaling, cuBLAS; dgrad and wgrad with split accumulation) 16.785 ms, fprop 1.906x, dgrad and
    # wgrad 1.898x. The same GH100 tensor cores as the SXM parts (at 600 rather than 700 W).
    fp8_matmul_efficiency=31.968 / 16.785 / 2,
    host_link_bytes_per_s=PCIE_GEN5_X16,
    host_memory_bandwidth_bytes_per_s=614.4 * GB / 8,
    host_memory_bytes=2048 * GIB / 8,
    board_power_w=H100_SXM_BOARD_POWER_W,
    clock_power_exponent=HOPPER_CLOCK_POWER_EXPONENT,
    sm_count=132,
    attention_kernels=HOPPER_ATTENTION_KERNELS,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM and NVL); DGX H100 datasheet (host)",
)
H200_SXM = replace(
    H100_SXM,
    name="H200 SXM 141GB",
    memory_bytes=140.4 * GIB,
    memory_bandwidth_bytes_per_s=4800 * GB,
    source="NVIDIA H200 product brief",
)
# Blackwell: the B200 of HGX/DGX B200 systems (1,000 W). Peaks from NVIDIA's HGX B200 table (dense,
# half its 2:4-sparsity figures): FP8 4.5 PF, bf16 2.25 PF, TF32 1.1 PF, FP32 75 TF; 180 GB HBM3e
# (nvidia-smi: 183,359 MiB) at 7.7 TB/s; 148 SMs (CUDA device query, pytorch/ao#4002); NVLink 5 at
# 1.8 TB/s per GPU. Matmul terms, where no B200 figure of our own kind exists, carry H100's over by
# one documented measurement of both parts, the maximum achievable matmul (best shape, torch.matmul,
# stas00/ml-engineering compute/accelerator, 2025): bf16 1,745 of 2,250 TF/s (77.6%) on B200 against
# 794.5 of 989 (80.3%) on H100, so H100's large-GEMM fraction times 77.6 / 80.3; float8 3,432.5 TF/s,
# 1.967x its bf16 (fp8_matmul_efficiency 0.98); a GEMM's size at half efficiency grows with the
# peak (the same fill time at 2.27x the rate). No fused attention kernel is documented here with all
# four rates (cuDNN's B200 benchmark charts the causal mask only): attention prices as a matmul of
# its count unless a profile measures it. Host: DGX B200, 2x Xeon 8570 (8 channels of DDR5-5600
# each: 716.8 GB/s), 2 TB, PCIe Gen5.
B200_BF16_TFLOPS = 2250.0
B200_MAMF_BF16_TFLOPS, B200_MAMF_FP8_TFLOPS, H100_MAMF_BF16_TFLOPS = 1745.0, 3432.5, 794.5
B200 = DeviceSpec(
    name="B200 180GB",
    peak_flops_per_s={"bf16": B200_BF16_TFLOPS * TFLOPS, "fp16": B200_BF16_TFLOPS * TFLOPS, "tf32": 1100 * TFLOPS,
                      "fp32": 75 * TFLOPS, "fp8": 2 * B200_BF16_TFLOPS * TFLOPS},
    memory_bytes=183359 * 2**20,
    memory_bandwidth_bytes_per_s=7700 * GB,
    matmul_efficiency=H100_SXM.matmul_efficiency * (B200_MAMF_BF16_TFLOPS / B200_BF16_TFLOPS)
    / (H100_MAMF_BF16_TFLOPS / H100_SXM_BF16_TFLOPS),
    matmul_half_efficiency_flops=H100_SXM.matmul_half_efficiency_flops * B200_BF16_TFLOPS / H100_SXM_BF16_TFLOPS,
    fp8_matmul_efficiency=B200_MAMF_FP8_TFLOPS / B200_MAMF_BF16_TFLOPS / 2,
    host_link_bytes_per_s=PCIE_GEN5_X16,
    host_memory_bandwidth_bytes_per_s=716.8 * GB / 8,
    host_memory_bytes=2048 * GIB / 8,
    board_power_w=1000.0,
    sm_count=148,
    source="NVIDIA HGX B200 specifications; DGX B200 user guide (host); ml-engineering MAMF table (matmul terms)",
)
V100_16G = DeviceSpec(
    name="V100 SXM2 16GB",
    peak_flops_per_s={"fp16": 125 * TFLOPS, "bf16": 15.7 * TFLOPS, "fp32": 15.7 * TFLOPS},
    memory_bytes=15.8 * GIB,
    memory_bandwidth_bytes_per_s=900 * GB,
    matmul_efficiency=0.75,
    host_link_bytes_per_s=PCIE_GEN3_X16,
    host_memory_bandwidth_bytes_per_s=153.6 * GB / 8,
    host_memory_bytes=488 * GIB / 8,
    sm_count=80,
    source="NVIDIA V100 datasheet (no bf16 tensor cores: bf16 runs at fp32 rate); AWS p3.16xlarge (host)",
)


def cpu_device(num_procs: int = 1) -> DeviceSpec:
    """This machine's CPU split evenly among `num_procs` processes (rough; profile to refine).

    Without a profile we assume 16 fp32 FLOP/cycle/core at 2.5 GHz (AVX2 FMA) and 10 GB/s of
    memory bandwidth per core; `autopar profile` measures the real figures.
    """
    num_cores = max(1, os.cpu_count() or 1)
    cores_per_proc = max(num_cores / max(num_procs, 1), 1.0 / max(num_procs, 1))
    flops = cores_per_proc * 2.5e9 * 16
    return DeviceSpec(
        name=f"CPU ({num_cores} cores, {num_procs} procs)",
        peak_flops_per_s={"fp32": flops, "bf16": flops / 4, "fp16": flops / 4},
        memory_bytes=_host_memory_bytes() / max(num_procs, 1),
        memory_bandwidth_bytes_per_s=cores_per_proc * 10 * GB,
        matmul_efficiency=0.5,
        matmul_half_efficiency_flops=2.0e7,
        memory_efficiency=0.5,
        kernel_overhead_s=10e-6,
        # The "device" memory is host memory: an offload copy is a memory copy, and moving states
        # to the host frees nothing (the search never offers offload on CPUs).
        host_link_bytes_per_s=cores_per_proc * 10 * GB,
        host_memory_bandwidth_bytes_per_s=cores_per_proc * 10 * GB,
        host_memory_bytes=_host_memory_bytes() / max(num_procs, 1),
        source="estimate from os.cpu_count(); run `autopar profile` for measured figures",
    )


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


# --- links ---------------------------------------------------------------------------------
# latency_s of the NCCL links is the Simple protocol's latency per ring step in NCCL's tuning
# model (src/graph/tuning.cc, NCCL 2.18-2.2x: 3.4 us per NVLink step, 14 us per network step).

NVLINK3 = LinkSpec(name="NVLink3/NVSwitch", bandwidth_bytes_per_s=300 * GB, latency_s=3.4e-6)
NVLINK4 = LinkSpec(name="NVLink4/NVSwitch", bandwidth_bytes_per_s=450 * GB, latency_s=3.4e-6)
NVLINK5 = LinkSpec(name="NVLink5/NVSwitch", bandwidth_bytes_per_s=900 * GB, latency_s=3.4e-6)
NVLINK2 = LinkSpec(name="NVLink2 hybrid cube-mesh", bandwidth_bytes_per_s=150 * GB, latency_s=3.4e-6, efficiency=0.7)
# 8x HDR 200 Gb/s per DGX A100 node: one 25 GB/s rail per GPU.
IB_HDR = LinkSpec(name="HDR InfiniBand 200 Gb/s per GPU", bandwidth_bytes_per_s=25 * GB, latency_s=14e-6, efficiency=0.8)
# 8x NDR 400 Gb/s per DGX H100 node: 50 GB/s per GPU.
IB_NDR = LinkSpec(name="NDR InfiniBand 400 Gb/s per GPU", bandwidth_bytes_per_s=50 * GB, latency_s=14e-6, efficiency=0.8)
# p3.16xlarge: 25 Gb/s Ethernet per node, shared by its 8 GPUs (NCCL's socket transport).
ETH_25G_PER_8 = LinkSpec(name="25 Gb/s Ethernet per node", bandwidth_bytes_per_s=25e9 / 8 / 8, latency_s=50e-6, efficiency=0.7)
LOOPBACK = LinkSpec(name="shared memory (gloo)", bandwidth_bytes_per_s=2 * GB, latency_s=50e-6, efficiency=0.5)
TCP_10G = LinkSpec(name="10 Gb/s TCP", bandwidth_bytes_per_s=1.25 * GB, latency_s=100e-6, efficiency=0.7)


# --- the collective library ----------------------------------------------------------------
# NCCL's tuning model (src/graph/tuning.cc, defaults of NCCL 2.18-2.2x; NCCL picks, per call, the
# algorithm and protocol its model says is fastest):
#   ring latency = base + (steps - inter steps) x intra step + inter steps x inter step
#   base (us)             LL 6.6   LL128 14.0   Simple 8.4
#   NVLink step (us)      LL 0.6   LL128 1.9    Simple 3.4
#   network step (us)     LL 2.7   LL128 4.0    Simple 14.0   (ring, several GPUs per node)
#   lone network step     LL 5.0   LL128 8.5    Simple 14.0   (one GPU per node: tree latency)
#   bus bandwidth         LL 1/2 (capped: llMaxBws)   LL128 0.92 (120 of 128 B)   Simple 1
#   Simple's ring all-reduce latency across nodes x1.4 (x1.9 before Ampere); in a ring across
#   nodes an intra-node step costs at least one proxy post (x3 for Simple); tree all-reduce:
#   base + 2 ((GPUs per node - 1) intra steps + log2(nodes) lone network steps), 0.92 of the bus
#   bandwidth for twice the bytes.
# Steps are given as fractions of the links' latency_s (Simple's), so a cluster file that
# overrides a link's latency moves every protocol's steps on that link.
_NVLINK_SIMPLE_STEP_US, _NET_SIMPLE_STEP_US = 3.4, 14.0
NCCL_SIMPLE = ProtocolSpec(name="Simple", launch_latency_s=8.4e-6, intra_hop_fraction=1.0, inter_hop_fraction=1.0,
                           lone_inter_hop_fraction=1.0, bandwidth_fraction=1.0, proxy_steps=3.0,
                           multi_node_all_reduce_latency_factor=1.4)
NCCL_LL128 = ProtocolSpec(name="LL128", launch_latency_s=14.0e-6, intra_hop_fraction=1.9 / _NVLINK_SIMPLE_STEP_US,
                          inter_hop_fraction=4.0 / _NET_SIMPLE_STEP_US, lone_inter_hop_fraction=8.5 / _NET_SIMPLE_STEP_US,
                          bandwidth_fraction=0.92)


def _nccl_ll(one_node_gbs: float, two_nodes_gbs: float, more_nodes_gbs: float) -> ProtocolSpec:
    """NCCL's LL protocol with its bus-bandwidth caps (llMaxBws) for one system."""
    return ProtocolSpec(name="LL", launch_latency_s=6.6e-6, intra_hop_fraction=0.6 / _NVLINK_SIMPLE_STEP_US,
                        inter_hop_fraction=2.7 / _NET_SIMPLE_STEP_US, lone_inter_hop_fraction=5.0 / _NET_SIMPLE_STEP_US,
                        bandwidth_fraction=0.5,
                        max_bus_bandwidth_bytes_per_s=(one_node_gbs * GB, two_nodes_gbs * GB, more_nodes_gbs * GB))


_NCCL_SOURCE = "NCCL src/graph/tuning.cc (tuner constants of NCCL 2.18-2.2x)"
# DGX A100: Ampere GPUs, AMD EPYC hosts (llMaxBws Ampere-N1 87.7, AMD-N2 22.5, AMD-N4 19.0 GB/s;
# 2 us proxy posts on AMD).
# Channels: 24 on an 8-GPU A100 NVSwitch node (NCCL_DEBUG=INFO "Channel 23/24", NVIDIA/nccl-tests#100;
# "24 would have been the number of channels needed for intra-node bandwidth", NVIDIA/nccl#652).
NCCL_DGX_A100 = CollectiveSpec(library="NCCL", protocols=(_nccl_ll(87.7, 22.5, 19.0), NCCL_LL128, NCCL_SIMPLE),
                               proxy_overhead_s=2e-6, channels=24,
                               source=_NCCL_SOURCE + "; channels: NVIDIA/nccl-tests#100, NVIDIA/nccl#652")
# DGX H100 / HGX H200: Hopper GPUs, Intel Xeon hosts (Hopper-N1 141, Intel-N2 39, Intel-N4 20.4).
# Channels: NCCL 2.2x logs "16 coll channels" on 8-GPU H100 nodes with one 400 Gb/s NIC per GPU
# (NCCL_DEBUG=INFO at 3 and 8 nodes: NVIDIA/nccl issues 1453 and 1814); NCCL's documentation of
# NCCL_MIN_NCHANNELS: "increasing the number of channels also increases the number of CUDA blocks
# NCCL uses ... however, it uses more CUDA compute resources".
NCCL_DGX_H100 = CollectiveSpec(library="NCCL", protocols=(_nccl_ll(141.0, 39.0, 20.4), NCCL_LL128, NCCL_SIMPLE),
                               proxy_overhead_s=1e-6, channels=16,
                               source=_NCCL_SOURCE + "; channels: NCCL_DEBUG=INFO logs (NVIDIA/nccl#1453, #1814)")
# DGX B200: Blackwell GPUs, Intel Xeon hosts. NCCL prices LL inside a node by GPU generation (its
# Blackwell row, from NCCL 2.25: twice Hopper's 141) and across nodes by host CPU (Intel-N2 39,
# Intel-N4 20.4, as on DGX H100); its step latencies are the same on every architecture.
# Channels: NCCL 2.25.1 logs "32 coll channels" on one 8x B200 node (NCCL_DEBUG=INFO, NVIDIA/nccl#1646).
NCCL_DGX_B200 = CollectiveSpec(library="NCCL", protocols=(_nccl_ll(2 * 141.0, 39.0, 20.4), NCCL_LL128, NCCL_SIMPLE),
                               proxy_overhead_s=1e-6, channels=32,
                               source=_NCCL_SOURCE + " and 2.25-2.27 (Blackwell rows); channels: NVIDIA/nccl#1646")
# p3.16xlarge: Volta GPUs, Intel hosts; LL128 is enabled only where the NIC sits behind the
# GPU's PCIe switch, which the sockets of an Ethernet node are not: not across nodes.
NCCL_P3 = CollectiveSpec(library="NCCL", protocols=(
    _nccl_ll(39.0, 39.0, 20.4), replace(NCCL_LL128, across_nodes=False),
    replace(NCCL_SIMPLE, multi_node_all_reduce_latency_factor=1.9)), proxy_overhead_s=1e-6, source=_NCCL_SOURCE)


# --- systems -------------------------------------------------------------------------------

SYSTEMS: dict[str, SystemSpec] = {
    "dgx-a100-40g": SystemSpec(
        name="dgx-a100-40g", device=A100_40G, devices_per_node=8, intra_node=NVLINK3, inter_node=IB_HDR,
        collectives=NCCL_DGX_A100, description="NVIDIA DGX A100 (8x A100 40GB, NVSwitch, 8x HDR 200 Gb/s)",
        source="DGX A100 datasheet"),
    "dgx-a100-80g": SystemSpec(
        name="dgx-a100-80g", device=A100_80G, devices_per_node=8, intra_node=NVLINK3, inter_node=IB_HDR,
        collectives=NCCL_DGX_A100,
        description="NVIDIA DGX A100 (8x A100 80GB, NVSwitch, 8x HDR 200 Gb/s), e.g. Selene",
        source="DGX A100 datasheet; Megatron-LM SC21 (arXiv 2104.04473) section 5"),
    "dgx-h100": SystemSpec(
        name="dgx-h100", device=H100_SXM, devices_per_node=8, intra_node=NVLINK4, inter_node=IB_NDR,
        collectives=NCCL_DGX_H100, description="NVIDIA DGX H100 (8x H100 SXM5, NVSwitch, 8x NDR 400 Gb/s)",
        source="DGX H100 datasheet"),
    "hgx-h200": SystemSpec(
        name="hgx-h200", device=H200_SXM, devices_per_node=8, intra_node=NVLINK4, inter_node=IB_NDR,
        collectives=NCCL_DGX_H100, description="NVIDIA HGX H200 (8x H200 141GB, NVSwitch, 8x NDR 400 Gb/s)",
        source="HGX H200 product brief"),
    "dgx-b200": SystemSpec(
        name="dgx-b200", device=B200, devices_per_node=8, intra_node=NVLINK5, inter_node=IB_NDR,
        collectives=NCCL_DGX_B200, description="NVIDIA DGX B200 (8x B200 180GB, NVLink 5, 8x NDR 400 Gb/s)",
        source="DGX B200 user guide; NVIDIA HGX B200 specifications"),
    "p3-16xlarge": SystemSpec(
        name="p3-16xlarge", device=V100_16G, devices_per_node=8, intra_node=NVLINK2, inter_node=ETH_25G_PER_8,
        collectives=NCCL_P3,
        description="AWS p3.16xlarge (8x V100 16GB, NVLink, 25 Gb/s between nodes), as in Alpa's evaluation",
        source="AWS EC2 P3 instance page"),
}


def cpu_system(num_procs: int) -> SystemSpec:
    """The local machine: `num_procs` gloo processes on one node."""
    return SystemSpec(
        name="cpu", device=cpu_device(num_procs), devices_per_node=num_procs, intra_node=LOOPBACK,
        inter_node=TCP_10G, description="this machine's CPU, one gloo process per device")


PRESET_NAMES: tuple[str, ...] = tuple(SYSTEMS) + ("cpu",)

__all__ = [
    "DTYPES", "GB", "GIB", "TFLOPS", "DeviceSpec", "LinkSpec", "ProtocolSpec", "CollectiveSpec", "SystemSpec",
    "SYSTEMS", "PRESET_NAMES",
    "cpu_device", "cpu_system",
]

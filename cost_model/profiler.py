"""`autopar profile`: measure this machine's devices and links and return a HardwareProfile.

What is measured, and how it feeds the cost model (compute.py, comm.py):

- kernel overhead: the per-call time of a tiny out-of-place op (`x.add(1)` on 16 elements),
  timed over many back-to-back calls. On a CPU this is eager dispatch plus allocation; on a GPU
  the launch rate, since the kernel itself is negligible.
- memory bandwidth: a streaming element-wise op (`mul(x, 2, out=y)`) on tensors several times
  larger than a last-level cache, read + write bytes counted (as the probe counts `io_bytes`).
  The output is preallocated: a fresh CPU tensor of this size comes from mmap and is paid in
  page faults (~5x slower than the copy itself), which would measure the allocator, not memory.
- element-wise rates: output elements per second of GELU and of softmax over rows, a second
  ceiling for arithmetic-heavy element-wise kernels (what bounds them on a CPU).
- matmul: square (m = n = k) matmuls over a size sweep per dtype; achieved FLOP/s per size.
- grouped matmul: torch._grouped_mm of 8 experts over rows per expert (profile_grouped.py);
  achieved FLOP/s by FLOPs per expert, what prices MoE expert matmuls.
  ComputeModel prices a kernel as overhead + flops / rate, so on a CPU (where the two add up)
  the overhead is taken off the measured time first; on a GPU back-to-back launches hide behind
  the previous kernel, so the per-call time is kept. "fp32" on a GPU is whatever torch runs for
  float32 (TF32 if `torch.backends.cuda.matmul.allow_tf32` is set).
- collectives (num_processes > 1): all_reduce, all_gather, reduce_scatter, all_to_all,
  broadcast and send_recv (ping-pong, half the round trip) over message sizes, on groups of 2,
  4, ... and all processes, in `torch.multiprocessing` workers (gloo on CPU, NCCL on CUDA).
  Message sizes follow comm.py: all_gather the gathered size, reduce_scatter the input size,
  all_to_all the per-device buffer. Each sample is the slowest rank's time; a point's time is the
  median of samples. Under torchrun the launched processes are measured instead: groups inside
  one node are "intra_node", groups of one process per node "inter_node".

Order: collectives first, compute last (in both modes). Compute is measured in one process (rank
0 under torchrun) with the torch threads each process of a `cpu:procs=N` cluster gets (cores / N)
while the others are idle. The workers are spawned, so a script calling run_profile needs the
`if __name__ == "__main__":` guard.

Robustness on a shared machine: sizes are timed in interleaved rounds (matmul: the whole sweep;
collectives: all message sizes of one op and group), so a burst of background load spreads over
the sweep instead of bending the curve at one size; every figure is a median; each sample runs
enough calls to last `min_sample_s`, so timer resolution and Python overhead do not count. A time
budget caps the number of rounds (at least 3 are kept). Load that lasts (other jobs on the
machine) still slows every figure: profile an otherwise idle machine.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import torch

from cost_model.errors import CostModelInputError
from cost_model.profile import (SCHEMA_VERSION, AttentionPoint, CollectivePoint, ElementwisePoint,
                                GroupedMatmulPoint, HardwareProfile, MatmulPoint)
from cost_model.profile_attention import measure_attention
from cost_model.profile_grouped import measure_grouped_matmuls
from cost_model.profile_options import FP8_DTYPES, FP8_FAST, TORCH_DTYPES, ProfileOptions
from cost_model.profile_collectives import (Launch, measure_collectives, plan_collectives, ranks_by_node,
                                            spawn_collectives, torchrun_launch)
from cost_model.profile_timing import (Progress, ProgressFn, Timer, compute_device, interleaved_medians,
                                       threads_per_process)

CPU_PROCESSES_PER_CORE = 4
"""More gloo processes than this per core would measure the scheduler, not the links."""

_STREAM_ELEMENTS = {"cpu": 2**25, "cuda": 2**28}  # fp32: 128 MiB (4x a 32 MiB L3), 1 GiB (>> L2)
_COMPUTE_SHARE = 0.45
"""Share of the time budget left to the compute phase when collectives are measured too."""
_BF16_SLOWDOWN_LIMIT = 4.0
"""Default CPU sweeps drop bf16 when it runs this many times slower than fp32 (no native bf16)."""


# --- entry point ---------------------------------------------------------------------------


def run_profile(options: ProfileOptions, *, progress: ProgressFn | None = None) -> HardwareProfile:
    """Measure compute, memory and (with several processes) collectives; see the module docstring.

    Under torchrun every launched process must call this; all of them return rank 0's profile.
    """
    launch = torchrun_launch()
    check_can_run(options, launch)
    probe_bf16 = options.device == "cpu" and options.matmul_dtypes is None
    options = options.resolved()
    report = Progress(progress if launch is None or launch.rank == 0 else None)
    report(_busy_note(), 0.0)
    started = time.perf_counter()
    deadline_s = time.time() + options.time_budget_s
    if launch is not None:
        return _run_under_torchrun(options, launch, report, deadline_s, probe_bf16=probe_bf16)
    num_processes = options.num_processes
    collectives: tuple[CollectivePoint, ...] = ()
    measures_collectives = num_processes > 1 and bool(options.collective_ops)
    if measures_collectives:  # first, as under torchrun, so both modes end with the compute phase
        collectives_deadline_s = deadline_s - _COMPUTE_SHARE * options.time_budget_s
        collectives = spawn_collectives(options, report.span(0.0, 1 - _COMPUTE_SHARE), collectives_deadline_s)
    compute_start = 1 - _COMPUTE_SHARE if measures_collectives else 0.0
    compute = _measure_compute(options, num_processes, report.span(compute_start, 1.0), deadline_s,
                               probe_bf16=probe_bf16)
    report(f"profile done in {time.perf_counter() - started:.1f} s", 1.0)
    return _assemble(options, num_processes, compute, collectives, processes_per_node=num_processes)


def _busy_note() -> str:
    """A warning when other jobs keep the CPUs busy (they slow every figure), else a start line."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "profiling"
    if load > 0.5 * cores:
        return (f"profiling on a busy machine (load average {load:.1f} on {cores} cores): other jobs will "
                "make the figures slow and noisy")
    return "profiling"


def check_can_run(options: ProfileOptions, launch: "Launch | None" = None) -> None:
    """Raise CostModelInputError (before anything is spawned) if this machine cannot run `options`."""
    if options.device == "cuda":
        _check_cuda(options, launch)
    elif launch is None:
        cores = os.cpu_count() or 1
        if options.num_processes > cores * CPU_PROCESSES_PER_CORE:
            raise CostModelInputError(
                f"profile: {options.num_processes} processes asked for, but this machine has {cores} CPU cores "
                f"and at most {cores * CPU_PROCESSES_PER_CORE} processes ({CPU_PROCESSES_PER_CORE} per core) give "
                f"meaningful timings; use num_processes <= {cores * CPU_PROCESSES_PER_CORE}, or run the profile "
                "under torchrun across several machines")
    if options.clock == "cpu":
        processes = launch.local_world_size if launch is not None else options.num_processes
        if options.device != "cpu" or threads_per_process("cpu", processes) != 1:
            raise CostModelInputError(
                f"profile: clock 'cpu' times one thread, but each process would run "
                f"{threads_per_process(options.device, processes)} torch threads on {options.device}; use clock "
                "'wall', or (on a CPU) at least as many processes as cores")
    if launch is not None and options.num_processes not in (1, launch.local_world_size):
        raise CostModelInputError(
            f"profile: under torchrun the measured processes are those torchrun started "
            f"(LOCAL_WORLD_SIZE={launch.local_world_size}); leave num_processes at 1 or set it to "
            f"{launch.local_world_size}, not {options.num_processes}")


def _check_cuda(options: ProfileOptions, launch: "Launch | None") -> None:
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CostModelInputError(
            f"profile: device 'cuda' asked for, but CUDA is not available (torch {torch.__version__}, {built}); "
            "run the profile on a GPU machine with a CUDA build of torch, or profile device 'cpu'")
    needed = launch.local_world_size if launch is not None else options.num_processes
    available = torch.cuda.device_count()
    if needed > available:
        raise CostModelInputError(
            f"profile: {needed} processes need one GPU each, but this machine has {available} visible GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"use num_processes <= {available}")


def _assemble(options: ProfileOptions, num_processes: int, compute: "_ComputeFigures",
              collectives: Sequence[CollectivePoint], *, processes_per_node: int) -> HardwareProfile:
    return HardwareProfile(
        schema_version=SCHEMA_VERSION,
        device_kind=options.device,
        device_name=_device_name(options.device, processes_per_node),
        num_processes=num_processes,
        memory_bytes=_memory_bytes(options.device, processes_per_node),
        memory_bandwidth_bytes_per_s=compute.bandwidth_bytes_per_s,
        kernel_overhead_s=compute.overhead_s,
        matmul=compute.matmul,
        collectives=tuple(collectives),
        elementwise=compute.elementwise,
        attention=compute.attention,
        grouped_matmul=compute.grouped_matmul,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
    )


# --- compute -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _ComputeFigures:
    overhead_s: float
    bandwidth_bytes_per_s: float
    matmul: tuple[MatmulPoint, ...]
    elementwise: tuple[ElementwisePoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    grouped_matmul: tuple[GroupedMatmulPoint, ...] = ()


def _measure_compute(options: ProfileOptions, num_processes: int, report: Progress,
                     deadline_s: float, *, probe_bf16: bool) -> _ComputeFigures:
    """Overhead, bandwidth and the matmul sweep, in this process with its share of the cores."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(options.device, num_processes))
    try:
        device = compute_device(options.device)
        timer = Timer(options.device, options.clock)
        report("kernel overhead", 0.0)
        overhead_s = _measure_overhead(timer, device, options, deadline_s)
        report(f"kernel overhead {overhead_s * 1e6:.1f} us; memory bandwidth", 0.05)
        bandwidth = _measure_bandwidth(timer, device, options, overhead_s, deadline_s)
        report(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; element-wise rates", 0.1)
        elementwise = _measure_elementwise(timer, device, options, overhead_s, deadline_s)
        report("matmul sweep", 0.15)
        dtypes = _without_slow_bf16(timer, device, options.matmul_dtypes) if probe_bf16 else options.matmul_dtypes
        dtypes = _with_fp8_where_supported(device, dtypes)
        matmul = _measure_matmuls(timer, device, replace(options, matmul_dtypes=dtypes), overhead_s,
                                  report.span(0.15, 0.9), deadline_s)
        report("grouped matmul sweep", 0.9)
        grouped = measure_grouped_matmuls(timer, device, replace(options, matmul_dtypes=dtypes),
                                          lambda call_s: _compute_time_s(options.device, call_s, overhead_s),
                                          deadline_s)
        report("attention sweep", 0.95)
        attention = measure_attention(timer, device, options, deadline_s)
    finally:
        torch.set_num_threads(previous_threads)
    return _ComputeFigures(overhead_s=overhead_s, bandwidth_bytes_per_s=bandwidth, matmul=matmul,
                           elementwise=elementwise, attention=attention, grouped_matmul=grouped)


def _measure_overhead(timer: Timer, device: torch.device, options: ProfileOptions, deadline_s: float) -> float:
    tiny = torch.zeros(16, device=device)
    [time_s] = interleaved_medians(timer, [lambda: tiny.add(1.0)], warmup=max(options.warmup, 10),
                                   repeats=options.repeats, min_sample_s=options.min_sample_s,
                                   deadline_s=deadline_s)
    return time_s


def _measure_bandwidth(timer: Timer, device: torch.device, options: ProfileOptions, overhead_s: float,
                       deadline_s: float) -> float:
    numel = _STREAM_ELEMENTS[options.device] // (2 if options.quick else 1)
    source = torch.ones(numel, device=device)
    target = torch.empty_like(source)
    [time_s] = interleaved_medians(timer, [lambda: torch.mul(source, 2.0, out=target)], warmup=options.warmup,
                                   repeats=options.repeats, min_sample_s=options.min_sample_s,
                                   deadline_s=deadline_s)
    moved_bytes = 2 * numel * source.element_size()
    return moved_bytes / _compute_time_s(options.device, time_s, overhead_s)


def _measure_elementwise(timer: Timer, device: torch.device, options: ProfileOptions, overhead_s: float,
                         deadline_s: float) -> tuple[ElementwisePoint, ...]:
    """Output elements per second of GELU ("transcendental"), softmax over rows of 1024
    ("normalize"), a bf16 -> fp32 cast ("upcast") and a bf16 multiply by a [1024, 1024] operand
    broadcast over the leading dim ("broadcast", as a causal mask over attention scores), into
    preallocated outputs like the bandwidth kernel. The last two stream from memory like the
    bandwidth kernel (its size)."""
    numel = 2**22 // (2 if options.quick else 1)
    source = torch.randn(numel, device=device)
    target = torch.empty_like(source)
    rows, row_target = source.view(-1, 1024), target.view(-1, 1024)
    wide = torch.empty(_STREAM_ELEMENTS[options.device] // (2 if options.quick else 1), device=device)
    narrow = torch.randn(wide.numel(), device=device, dtype=torch.bfloat16)
    blocks, table = narrow.view(-1, 1024, 1024), torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    blocks_out = torch.empty_like(blocks)
    cases = {"transcendental": lambda: torch.ops.aten.gelu.out(source, out=target),
             "normalize": lambda: torch.ops.aten._softmax.out(rows, -1, False, out=row_target),
             "upcast": lambda: wide.copy_(narrow),
             "broadcast": lambda: torch.mul(blocks, table, out=blocks_out)}
    times = interleaved_medians(timer, list(cases.values()), warmup=options.warmup, repeats=options.repeats,
                                min_sample_s=options.min_sample_s, deadline_s=deadline_s)
    sizes = {"upcast": wide.numel(), "broadcast": wide.numel()}
    return tuple(ElementwisePoint(kind=kind, elements_per_s=sizes.get(kind, numel)
                                  / _compute_time_s(options.device, time_s, overhead_s))
                 for kind, time_s in zip(cases, times))


def _compute_time_s(device: str, call_s: float, overhead_s: float) -> float:
    """The part of a measured call that ComputeModel prices besides its per-kernel overhead.

    CPU calls are synchronous (overhead + work). GPU launches overlap the previous kernel, so
    the call time is the kernel's. Half the call is kept in any case, against timing noise.
    """
    if device == "cuda":
        return call_s
    return max(call_s - overhead_s, 0.5 * call_s)


def _measure_matmuls(timer: Timer, device: torch.device, options: ProfileOptions, overhead_s: float,
                     report: Progress, deadline_s: float) -> tuple[MatmulPoint, ...]:
    cases, keys = [], []
    for dtype in options.matmul_dtypes:
        for size in options.matmul_sizes:
            if dtype in FP8_DTYPES:
                cases.append(_scaled_mm_case(size, device, fast_accumulation=dtype == FP8_FAST))
            else:
                left, right = _matmul_operands(size, TORCH_DTYPES[dtype], device)
                cases.append(lambda left=left, right=right: torch.matmul(left, right))
            keys.append((dtype, size))
    repeats = options.repeats

    def on_round(done: int) -> None:
        report(f"matmul sweep round {done}/{repeats}", done / repeats)

    times = interleaved_medians(timer, cases, warmup=options.warmup, repeats=repeats,
                                min_sample_s=options.min_sample_s, deadline_s=deadline_s, on_round=on_round)
    points = [MatmulPoint(dtype=dtype, flops=2.0 * size**3,
                          achieved_flops_per_s=2.0 * size**3 / _compute_time_s(options.device, time_s, overhead_s))
              for (dtype, size), time_s in zip(keys, times)]
    return tuple(sorted(points, key=lambda point: (point.dtype, point.flops)))


def _matmul_operands(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Random normal data, made on the device: zeros or constants could take fast paths.
    return (torch.randn(size, size, dtype=dtype, device=device), torch.randn(size, size, dtype=dtype, device=device))


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: torch._scaled_mm runs on CUDA compute capability 8.9+ (Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _with_fp8_where_supported(device: torch.device, dtypes: tuple[str, ...]) -> tuple[str, ...]:
    return dtypes if fp8_supported(device) else tuple(dtype for dtype in dtypes if dtype not in FP8_DTYPES)


def _scaled_mm_case(size: int, device: torch.device, *, fast_accumulation: bool) -> Callable[[], object]:
    """A float8 matmul as torchao's float8 linears run it: e4m3 operands (the right one
    column-major, as _scaled_mm requires), fp32 tensorwise scales, bf16 out; with fast
    accumulation (their forward matmul) or split (their backward ones)."""
    left, right = _matmul_operands(size, torch.bfloat16, device)
    left, right = left.to(torch.float8_e4m3fn), right.to(torch.float8_e4m3fn).t().contiguous().t()
    scale = torch.ones((), dtype=torch.float32, device=device)
    return lambda: torch._scaled_mm(left, right, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accumulation)


def _without_slow_bf16(timer: Timer, device: torch.device, dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """Drop bf16 from a default CPU sweep when the CPU has no native bf16 (it is then emulated,
    many times slower than fp32, and nobody would train in it on that machine)."""
    if "bf16" not in dtypes:
        return dtypes
    fp32_s, bf16_s = (_quick_median_s(timer, lambda pair=pair: torch.matmul(*pair))
                      for pair in (_matmul_operands(256, dtype, device) for dtype in (torch.float32, torch.bfloat16)))
    if bf16_s > _BF16_SLOWDOWN_LIMIT * fp32_s:
        return tuple(dtype for dtype in dtypes if dtype != "bf16")
    return dtypes


def _quick_median_s(timer: Timer, function: Callable[[], object], samples: int = 5) -> float:
    function()  # the first call may build a kernel (oneDNN primitives, cuBLAS handles)
    return statistics.median(timer.per_call_s(function) for _ in range(samples))


def _device_name(device: str, num_processes: int) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    cores, threads = os.cpu_count() or 1, threads_per_process("cpu", num_processes)
    return f"CPU ({cores} cores, {_cpu_model()}, {threads} torch thread{'s' * (threads != 1)} per process)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_bytes(device: str, num_processes: int) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        host_bytes = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        host_bytes = 16.0 * 2**30
    return host_bytes / num_processes


# --- collectives: under torchrun -----------------------------------------------------------


def _run_under_torchrun(options: ProfileOptions, launch: Launch, report: Progress,
                        deadline_s: float, *, probe_bf16: bool) -> HardwareProfile:
    """Every torchrun process measures collectives; rank 0 also measures compute; all return
    rank 0's profile."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    if owns_group:
        if options.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if options.device == "cuda" else "gloo")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(options.device, launch.local_world_size))
    try:
        cases = plan_collectives(options, ranks_by_node(launch))
        collectives_deadline_s = deadline_s - _COMPUTE_SHARE * options.time_budget_s
        points = measure_collectives(options, cases, launch.rank, collectives_deadline_s,
                                     report.span(0.0, 1 - _COMPUTE_SHARE))
        profile = None
        if launch.rank == 0:
            compute = _measure_compute(options, launch.local_world_size, report.span(1 - _COMPUTE_SHARE, 1.0),
                                       deadline_s, probe_bf16=probe_bf16)
            profile = _assemble(options, launch.world_size, compute, points,
                                processes_per_node=launch.local_world_size)
        shared = [profile]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]
    finally:
        torch.set_num_threads(previous_threads)
        if owns_group:
            dist.destroy_process_group()

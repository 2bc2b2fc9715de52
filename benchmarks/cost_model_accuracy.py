"""How well does the cost model, fed a profile of this machine, predict what this machine does?

    .venv/bin/python benchmarks/cost_model_accuracy.py            # full profile (~1 min), then the suite
    .venv/bin/python benchmarks/cost_model_accuracy.py --quick    # quick profile
    .venv/bin/python benchmarks/cost_model_accuracy.py --markdown # also print the tables as markdown

1. Profile the machine (`run_profile`) with `--procs` processes (collectives on groups of 2 and 4).
2. Ops: each op of the suite is captured with `autopar.capture.capture` (the planner's view: its
   kernels' FLOPs and bytes), priced with `ComputeModel(device, profile).kernels(...)`, and timed
   in this process with the torch threads one profiled process had, right after the profile's
   compute phase. Op timings are medians of interleaved rounds, like the profile's.
3. Collectives: for 2 and 4 gloo processes, priced with
   `CommModel(Cluster.from_spec("cpu:procs=N,profile=..."))` and timed in N freshly spawned
   processes (barrier, k back-to-back calls, slowest rank, median of samples). The message sizes
   are deliberately not the profile's grid points, so interpolation is tested too. A second
   column fits the same alpha-beta line on the points of that group size only.
4. Controls (not in the medians): a matmul and an all-reduce the profile itself measured, timed
   again. Their error is the machine's drift between the profile and the suite, not the model's.
5. With one thread per process, the compute side is repeated on the CPU clock (thread CPU time,
   `ProfileOptions(clock="cpu")`): on a machine shared with other jobs this removes the time they
   held the core, which is what separates model error from contention.

Error is (predicted - measured) / measured; the summary is the median absolute error.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.capture.export import capture  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.models import build_model  # noqa: E402
from cost_model.comm import CommModel, Group, latency_steps, volume_factor  # noqa: E402
from cost_model.compute import ComputeModel  # noqa: E402
from cost_model.hardware import cpu_device  # noqa: E402
from cost_model.profile import HardwareProfile, load_profile  # noqa: E402
from cost_model.profiler import (ProfileOptions, Timer, interleaved_medians, run_profile,  # noqa: E402
                                 threads_per_process)

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# Off the profile's grid (which steps by 4x from 4 KiB): 48 KB, 1 MB, 6 MB, 24 MB.
COLLECTIVE_SIZES_BYTES = (48_000, 1_000_000, 6_000_000, 24_000_000)
GROUP_SIZES = (2, 4)
CONTROL_BYTES = 4 * 2**20
GPT_SPEC = "gpt:layers=1,hidden=256,heads=4,seq=128,vocab=512"


# --- the op suite --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OpCase:
    """One op (or model) to predict and time."""

    name: str
    module: nn.Module
    inputs: tuple
    loss_fn: Callable | None = None
    """With a loss: forward + backward (of loss_fn(module(*inputs), targets)) is priced and timed."""
    targets: torch.Tensor | None = None
    control: bool = False
    """A size the profile itself measured: its error is drift of the machine, not model error."""


class Matmul(nn.Module):
    def forward(self, left, right):
        return left @ right


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.linear(x)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x)


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class Gelu(nn.Module):
    def forward(self, x):
        return F.gelu(x)


class EagerAttention(nn.Module):
    def forward(self, query, key, value):
        scores = (query @ key.transpose(-2, -1)) * query.shape[-1] ** -0.5
        return torch.softmax(scores, dim=-1) @ value


class FusedAttention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value, is_causal=self.causal)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _matmul(name: str, m: int, k: int, n: int, dtype: torch.dtype = torch.float32) -> OpCase:
    return OpCase(name=name, module=Matmul(), inputs=(_randn(m, k, dtype=dtype), _randn(k, n, dtype=dtype)))


def op_suite() -> list[OpCase]:
    """Shapes of a small GPT (tokens = 8 x 128, hidden 256) plus larger and skinnier ones."""
    qkv = tuple(_randn(8, 4, 128, 64) for _ in range(3))
    cases = [
        replace(_matmul("mm 512^3 (control: a profile point)", 512, 512, 512), control=True),
        _matmul("mm 200^3", 200, 200, 200),
        _matmul("mm 700^3", 700, 700, 700),
        _matmul("mm 1400^3", 1400, 1400, 1400),
        _matmul("mm 700^3 bf16", 700, 700, 700, torch.bfloat16),
        _matmul("mm 1024x256 @ 256x768 (qkv)", 1024, 256, 768),
        _matmul("mm 1024x256 @ 256x1024 (mlp up)", 1024, 256, 1024),
        _matmul("mm 1024x1024 @ 1024x256 (mlp down)", 1024, 1024, 256),
        _matmul("mm 1024x256 @ 256x1024 bf16", 1024, 256, 1024, torch.bfloat16),
        _matmul("mm 16384x64 @ 64x64 (tall)", 16384, 64, 64),
        _matmul("mm 64x8192 @ 8192x64 (long k)", 64, 8192, 64),
        OpCase(name="linear 4096x1024 -> 1024 (addmm)", module=Linear(1024, 1024), inputs=(_randn(4096, 1024),)),
        OpCase(name="layernorm 8x128x256", module=LayerNorm(256), inputs=(_randn(8, 128, 256),)),
        OpCase(name="layernorm 8x512x1024", module=LayerNorm(1024), inputs=(_randn(8, 512, 1024),)),
        OpCase(name="softmax 8x4x128x128", module=Softmax(), inputs=(_randn(8, 4, 128, 128),)),
        OpCase(name="softmax 4x8x256x256", module=Softmax(), inputs=(_randn(4, 8, 256, 256),)),
        OpCase(name="gelu 8x128x1024", module=Gelu(), inputs=(_randn(8, 128, 1024),)),
        OpCase(name="gelu 8x512x4096", module=Gelu(), inputs=(_randn(8, 512, 4096),)),
        OpCase(name="attention eager 8x4x128x64", module=EagerAttention(), inputs=qkv),
        OpCase(name="attention sdpa 8x4x128x64", module=FusedAttention(causal=False), inputs=qkv),
        OpCase(name="attention sdpa causal 8x4x128x64", module=FusedAttention(causal=True), inputs=qkv),
    ]
    for attention in ("eager", "sdpa"):
        bundle = build_model(f"{GPT_SPEC},attention={attention}", batch_size=8, device="cpu", seed=0)
        cases.append(OpCase(name=f"gpt block fwd+bwd ({attention} attn)", module=bundle.model,
                            inputs=bundle.example_inputs, loss_fn=bundle.loss_fn, targets=bundle.example_targets))
    return cases


def predict_op_s(case: OpCase, model: ComputeModel) -> float:
    """Sum of the priced kernels of the captured graph (forward, and backward with a loss)."""
    graph = capture(case.module, case.inputs, loss_fn=case.loss_fn, example_targets=case.targets,
                    dynamic_batch=False)
    total_s = 0.0
    for node in graph.calls():
        total_s += model.kernels(node.fwd_kernels).total_s
        if case.loss_fn is not None:
            total_s += model.kernels(node.bwd_kernels).total_s
    return total_s


def op_callable(case: OpCase) -> Callable[[], object]:
    if case.loss_fn is None:
        return lambda: case.module(*case.inputs)
    parameters = list(case.module.parameters())

    def step() -> None:
        for parameter in parameters:
            parameter.grad = None
        case.loss_fn(case.module(*case.inputs), case.targets).backward()

    return step


def measure_ops_s(cases: list[OpCase], *, repeats: int, clock: str) -> list[float]:
    """Median per-call time of each case, in interleaved rounds (forward-only ops under no_grad)."""
    timer = Timer("cpu", clock)
    with torch.no_grad():
        forward_only = [op_callable(case) for case in cases if case.loss_fn is None]
        forward_times = interleaved_medians(timer, forward_only, warmup=3, repeats=repeats,
                                            min_sample_s=0.03, deadline_s=math.inf)
    with_backward = [op_callable(case) for case in cases if case.loss_fn is not None]
    backward_times = interleaved_medians(timer, with_backward, warmup=3, repeats=repeats,
                                         min_sample_s=0.03, deadline_s=math.inf)
    forward_iter, backward_iter = iter(forward_times), iter(backward_times)
    return [next(backward_iter) if case.loss_fn is not None else next(forward_iter) for case in cases]


# --- collectives ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _collective(op: str, message_bytes: int, group_size: int, rank: int) -> tuple[Callable[[], object], int]:
    import torch.distributed as dist

    numel = max(group_size, round(message_bytes / 4 / group_size) * group_size)
    full, part, other = torch.zeros(numel), torch.zeros(numel // group_size), torch.zeros(numel)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(other, full),
    }
    return calls[op], numel * 4


def _time_collective(op: str, call: Callable[[], object], repeats: int) -> float:
    """Median over samples of the slowest rank's per-call time (samples last >= 20 ms)."""
    import torch.distributed as dist

    for _ in range(2):
        call()
    start = time.perf_counter()
    call()
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    calls = max(1, min(200, math.ceil(0.02 / once.item())))
    samples = torch.zeros(repeats, dtype=torch.float64)
    for index in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples[index] = (time.perf_counter() - start) / calls
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return statistics.median(samples.tolist())


def _collective_worker(rank: int, world_size: int, port: int, cases: list[tuple[str, int]], repeats: int,
                       results) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_process("cpu", world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for op, size in cases:
            call, message_bytes = _collective(op, size, world_size, rank)
            time_s = _time_collective(op, call, repeats)
            if rank == 0:
                results.put((op, message_bytes, time_s))
    finally:
        dist.destroy_process_group()


def measure_collectives(world_size: int, repeats: int, cases: list[tuple[str, int]]) -> list[tuple[str, int, float]]:
    """(op, message bytes, median seconds) for each (op, size), on `world_size` new gloo processes."""
    import torch.multiprocessing as torch_mp

    context = torch_mp.get_context("spawn")
    results = context.Queue()
    workers = torch_mp.start_processes(_collective_worker, args=(world_size, _free_port(), cases, repeats, results),
                                       nprocs=world_size, join=False, start_method="spawn")
    rows = []
    while not workers.join(timeout=0.1):
        while not results.empty():
            rows.append(results.get())
    while not results.empty():
        rows.append(results.get())
    return rows


# --- report --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One prediction and the measurement it is compared with."""

    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    views: tuple[Estimate | None, ...]
    """views[0] is the headline (the cost model fed the wall-clock profile); see View."""
    control: bool = False
    """Not in the medians: the prediction is the profile's own measurement of the same thing."""


@dataclass(frozen=True, kw_only=True)
class View:
    """A column group of a table."""

    label: str
    """Prefix of the column names ("" for the headline)."""
    own_measurement: bool
    """Whether the view has its own measured column (else it shares the headline's)."""


def median_abs_error(rows: list[Row], view: int = 0) -> float:
    errors = [abs(row.views[view].error) for row in rows if not row.control and row.views[view] is not None]
    return statistics.median(errors) if errors else math.nan


def format_table(title: str, rows: list[Row], views: tuple[View, ...], *, markdown: bool) -> str:
    """Name, then per view: predicted ms, (measured ms), error; the last line has the medians."""
    kept = [index for index in range(len(views)) if any(row.views[index] for row in rows)]
    header = [title] + [cell for index in kept for cell in _view_header(views[index])]
    body = [[row.name] + [cell for index in kept for cell in _view_cells(views[index], row.views[index])]
            for row in rows]
    summary = ["median absolute error (controls excluded)"] + [
        cell for index in kept
        for cell in [""] * (len(_view_header(views[index])) - 1) + [f"{median_abs_error(rows, index):.0%}"]]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines + ["| " + " | ".join(f"**{cell}**" if cell else "" for cell in summary) + " |"])
    widths = [max(len(cells[column]) for cells in [header, summary, *body]) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                               for column, (cell, width) in enumerate(zip(cells, widths)))
                     for cells in [header, *body, summary])


def _view_header(view: View) -> list[str]:
    prefix = f"{view.label} " if view.label else ""
    return [f"{prefix}predicted ms"] + ([f"{prefix}measured ms"] if view.own_measurement else []) + [f"{prefix}error"]


def _view_cells(view: View, estimate: Estimate | None) -> list[str]:
    if estimate is None:
        return [""] * len(_view_header(view))
    cells = [f"{estimate.predicted_s * 1e3:.3f}"]
    if view.own_measurement:
        cells.append(f"{estimate.measured_s * 1e3:.3f}")
    return cells + [f"{estimate.error:+.0%}"]


def describe_profile(profile: HardwareProfile, elapsed_s: float) -> str:
    rates = ", ".join(f"{point.dtype} {round((point.flops / 2) ** (1 / 3))}: {point.achieved_flops_per_s / 1e9:.0f}"
                      for point in profile.matmul)
    return (f"profile ({elapsed_s:.0f} s): {profile.device_name}; bandwidth "
            f"{profile.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; overhead {profile.kernel_overhead_s * 1e6:.1f} us; "
            f"{len(profile.collectives)} collective points\nmatmul GFLOP/s by size: {rates}")


def cpu_pressure() -> str:
    """Share of the last minute in which runnable tasks waited for a CPU (Linux PSI), if known."""
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "n/a"
    return some.split("avg60=")[1].split()[0] + "%"


# --- ops -----------------------------------------------------------------------------------

OP_VIEWS = (View(label="", own_measurement=True), View(label="CPU-clock", own_measurement=True))


def price_and_time(cases: list[OpCase], profile: HardwareProfile, repeats: int, clock: str) -> list[Estimate]:
    """Each op priced with ComputeModel(profile) and timed (median) on `clock`."""
    model = ComputeModel(cpu_device(profile.num_processes), profile)
    predicted = [predict_op_s(case, model) for case in cases]
    measured = measure_ops_s(cases, repeats=repeats, clock=clock)
    return [Estimate(predicted_s=p, measured_s=m) for p, m in zip(predicted, measured)]


def op_rows(cases: list[OpCase], wall: list[Estimate], cpu: list[Estimate] | None) -> list[Row]:
    cpu = cpu or [None] * len(cases)
    return [Row(name=case.name, views=(w, c), control=case.control) for case, w, c in zip(cases, wall, cpu)]


# --- collectives: prediction ---------------------------------------------------------------

COLLECTIVE_VIEWS = (View(label="", own_measurement=True), View(label="per-n fit", own_measurement=False),
                    View(label="per-n relative fit", own_measurement=False))


def collective_rows(profile_path: Path, repeats: int) -> list[Row]:
    """CommModel's prediction and two refits that show where its error comes from: the same
    least-squares alpha-beta line fitted on this group size's points only, and that fit weighted
    by 1/t^2 (relative error, so small messages pin the latency). A control row compares the
    profile's own all_reduce point with a new measurement of it: that difference is drift."""
    cases = [(op, size) for op in COLLECTIVE_OPS for size in COLLECTIVE_SIZES_BYTES]
    rows = []
    for group_size in GROUP_SIZES:
        cluster = Cluster.from_spec(f"cpu:procs={group_size},profile={profile_path}")
        model, per_size = CommModel(cluster), CommModel(_only_group_size(cluster, group_size))
        group = Group(num_nodes=1, devices_per_node=group_size)
        control, *measured = measure_collectives(group_size, repeats, [("all_reduce", CONTROL_BYTES)] + cases)
        rows += _control_row(cluster.profile, group_size, control[2])
        for op, message_bytes, measured_s in measured:
            predictions = (model.time_s(op, message_bytes, group), per_size.time_s(op, message_bytes, group),
                           relative_fit_s(cluster.profile, op, group_size, message_bytes))
            rows.append(Row(name=f"{op} x{group_size} {message_bytes / 1e6:g} MB",
                            views=tuple(Estimate(predicted_s=p, measured_s=measured_s) for p in predictions)))
    return rows


def relative_fit_s(profile: HardwareProfile, op: str, group_size: int, message_bytes: float) -> float:
    """comm.py's t = alpha x steps + volume / bw, fitted on this op and group size only, minimising
    the relative error sum(((alpha s + v / bw) - t) / t)^2 instead of the absolute one."""
    scaled = [(latency_steps(p.op, p.num_devices) / p.time_s,
               volume_factor(p.op, p.num_devices) * p.message_bytes / p.time_s)
              for p in profile.collectives if p.op == op and p.num_devices == group_size]
    ss = sum(s * s for s, _ in scaled)
    sv = sum(s * v for s, v in scaled)
    vv = sum(v * v for _, v in scaled)
    s1, v1 = sum(s for s, _ in scaled), sum(v for _, v in scaled)  # each scaled target is 1
    latency_s = (s1 * vv - v1 * sv) / (ss * vv - sv * sv)
    inverse_bw = (ss * v1 - sv * s1) / (ss * vv - sv * sv)
    if latency_s < 0:
        latency_s, inverse_bw = 0.0, v1 / vv
    return latency_s * latency_steps(op, group_size) + inverse_bw * volume_factor(op, group_size) * message_bytes


def _control_row(profile: HardwareProfile, group_size: int, measured_s: float) -> list[Row]:
    """[] when the profile did not measure that point (a profile given with --profile)."""
    return [Row(name=f"all_reduce x{group_size} 4 MiB (control: a profile point)",
                views=(Estimate(predicted_s=point.time_s, measured_s=measured_s), None, None), control=True)
            for point in profile.collectives
            if (point.op, point.num_devices, point.message_bytes) == ("all_reduce", group_size, CONTROL_BYTES)]


def _only_group_size(cluster: Cluster, group_size: int) -> Cluster:
    points = tuple(point for point in cluster.profile.collectives if point.num_devices == group_size)
    return replace(cluster, profile=replace(cluster.profile, collectives=points))


# --- main ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="quick profile (smaller sweeps)")
    parser.add_argument("--procs", type=int, default=4, help="processes to profile collectives on (default 4)")
    parser.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
    parser.add_argument("--no-cpu-clock", action="store_true",
                        help="skip the second, CPU-clock profile and op timings")
    parser.add_argument("--repeats", type=int, default=9, help="timed samples per op / collective")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    parser.add_argument("--save-profile", type=Path, help="keep the measured profile at this path")
    return parser.parse_args()


def _print_progress(message: str, fraction: float) -> None:
    print(f"  [{fraction:4.0%}] {message}", file=sys.stderr)


def profile_machine(args: argparse.Namespace, directory: Path) -> tuple[HardwareProfile, Path]:
    if args.profile is not None:
        return load_profile(args.profile), args.profile.resolve()
    started = time.perf_counter()
    profile = run_profile(ProfileOptions(num_processes=args.procs, quick=args.quick), progress=_print_progress)
    path = args.save_profile or directory / "profile.json"
    profile.save(path)
    print(describe_profile(profile, time.perf_counter() - started))
    return profile, path


def cpu_clock_profile(args: argparse.Namespace, num_processes: int) -> HardwareProfile | None:
    """The compute part of the profile again, timed by thread CPU time (one thread per process)."""
    if args.no_cpu_clock or threads_per_process("cpu", num_processes) != 1:
        return None
    started = time.perf_counter()
    profile = run_profile(ProfileOptions(num_processes=num_processes, quick=args.quick, clock="cpu",
                                         collective_ops=()), progress=_print_progress)
    print("CPU-clock " + describe_profile(profile, time.perf_counter() - started))
    return profile


def main() -> None:
    args = parse_args()
    load_before, pressure_before = os.getloadavg()[0], cpu_pressure()
    with tempfile.TemporaryDirectory() as directory:
        profile, path = profile_machine(args, Path(directory))
        # Ops right after the profile's compute phase (its last), with one profiled process's threads.
        torch.set_num_threads(threads_per_process("cpu", profile.num_processes))
        torch.manual_seed(0)
        cases = op_suite()
        wall = price_and_time(cases, profile, args.repeats, "wall")
        collectives = collective_rows(path, args.repeats)
    cpu_profile = cpu_clock_profile(args, profile.num_processes)
    cpu = price_and_time(cases, cpu_profile, args.repeats, "cpu") if cpu_profile is not None else None
    ops = op_rows(cases, wall, cpu)
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; CPU pressure (PSI some avg60) "
          f"{pressure_before} before, {cpu_pressure()} after; {os.cpu_count()} cores\n")
    for markdown in (False, True) if args.markdown else (False,):
        print(format_table("op", ops, OP_VIEWS, markdown=markdown) + "\n")
        print(format_table("collective", collectives, COLLECTIVE_VIEWS, markdown=markdown) + "\n")
    cpu_clock = f" (CPU clock: {median_abs_error(ops, 1):.0%})" if cpu is not None else ""
    print(f"median absolute error: ops {median_abs_error(ops):.0%}{cpu_clock}; "
          f"collectives {median_abs_error(collectives):.0%} (per-n fit {median_abs_error(collectives, 1):.0%}, "
          f"per-n relative fit {median_abs_error(collectives, 2):.0%})")


if __name__ == "__main__":
    main()

"""The collective sweep of `autopar profile`: groups of spawned local processes (gloo on CPU,
NCCL on GPU) or the processes of a torchrun launch, each collective timed over message sizes.
See profiler.py for what is measured and how the cost model uses it.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from cost_model.profile import CollectivePoint
from cost_model.profile_options import ProfileOptions
from cost_model.profile_timing import Progress, ProgressFn, Timer, calls_for, compute_device, threads_per_process


# --- collectives: the plan -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Where this process sits in a torchrun launch (read from the environment)."""

    rank: int
    world_size: int
    local_world_size: int


def torchrun_launch() -> Launch | None:
    """The torchrun launch this process belongs to, if any (WORLD_SIZE > 1 and LOCAL_WORLD_SIZE set)."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        rank = int(os.environ.get("RANK", "0"))
    except (KeyError, ValueError):
        return None
    if world_size <= 1:
        return None
    return Launch(rank=rank, world_size=world_size, local_world_size=local_world_size)


@dataclass(frozen=True, kw_only=True)
class _Case:
    """One collective measurement: an op on a group of global ranks at one message size."""

    op: str
    level: str
    ranks: tuple[int, ...]
    message_bytes: int


def _group_sizes(num_members: int) -> list[int]:
    """2, 4, 8, ... up to num_members, and num_members itself."""
    sizes = [2**power for power in range(1, num_members.bit_length()) if 2**power <= num_members]
    return sorted(set(sizes + [num_members])) if num_members >= 2 else []


def plan_collectives(options: ProfileOptions, ranks_by_node: Sequence[Sequence[int]]) -> list[_Case]:
    """The cases to measure: groups inside the first node, then one rank per node (if several)."""
    levels = [("intra_node", list(ranks_by_node[0]))]
    if len(ranks_by_node) > 1:
        levels.append(("inter_node", [node_ranks[0] for node_ranks in ranks_by_node]))
    cases = []
    for level, members in levels:
        for op in options.collective_ops:
            sizes = [2] if op == "send_recv" else _group_sizes(len(members))
            for group_size in sizes:
                if group_size > len(members):
                    continue
                cases += [_Case(op=op, level=level, ranks=tuple(members[:group_size]), message_bytes=message)
                          for message in options.message_sizes_bytes]
    return cases


# --- collectives: spawning local workers ---------------------------------------------------


def spawn_collectives(options: ProfileOptions, report: Progress, deadline_s: float) -> tuple[CollectivePoint, ...]:
    """Run the collective sweep in `num_processes` local workers; rank 0 sends back the points."""
    import torch.multiprocessing as torch_mp

    context = torch_mp.get_context("spawn")
    messages = context.Queue()
    port = _free_port()
    report(f"starting {options.num_processes} {'NCCL' if options.device == 'cuda' else 'gloo'} processes", 0.0)
    workers = torch_mp.start_processes(_collective_worker, args=(options, port, deadline_s, messages),
                                       nprocs=options.num_processes, join=False, start_method="spawn")
    points: list[dict] = []
    while True:
        finished = workers.join(timeout=0.1)
        points += _drain(messages, report)
        if finished:
            break
    points += _drain(messages, report)
    return tuple(CollectivePoint(**point) for point in points)


def _drain(messages, report: Progress) -> list[dict]:
    points = []
    while True:
        try:
            kind, payload = messages.get_nowait()
        except queue_module.Empty:
            return points
        if kind == "progress":
            report(*payload)
        else:
            points += payload


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _collective_worker(rank: int, options: ProfileOptions, port: int, deadline_s: float, messages) -> None:
    """One spawned process: join the group, measure, and (rank 0) put the points on the queue."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world_size = options.num_processes
    torch.set_num_threads(threads_per_process(options.device, world_size))
    if options.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if options.device == "cuda" else "gloo", rank=rank, world_size=world_size)
    try:
        def report(message: str, fraction: float) -> None:
            messages.put(("progress", (message, fraction)))

        cases = plan_collectives(options, [list(range(world_size))])
        points = measure_collectives(options, cases, rank, deadline_s, report if rank == 0 else None)
        if rank == 0:
            messages.put(("points", [asdict(point) for point in points]))
    finally:
        dist.destroy_process_group()


def ranks_by_node(launch: Launch) -> list[list[int]]:
    """Global ranks grouped by host (torchrun's GROUP_RANK, else the host name), node 0 first."""
    import torch.distributed as dist

    node_key = os.environ.get("GROUP_RANK") or socket.gethostname()
    keys: list[str | None] = [None] * launch.world_size
    dist.all_gather_object(keys, node_key)
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(str(key), []).append(rank)
    return sorted(nodes.values(), key=lambda ranks: ranks[0])


# --- collectives: measuring ----------------------------------------------------------------


def measure_collectives(options: ProfileOptions, cases: Sequence[_Case], rank: int, deadline_s: float,
                        report: ProgressFn | None) -> list[CollectivePoint]:
    """Every rank of the default group runs every case (non-members only join the bookkeeping);
    returns the points (meaningful on rank 0). The message sizes of one op on one group form a
    block, timed in interleaved rounds like the matmul sweep."""
    import torch.distributed as dist

    device = compute_device(options.device)
    groups = _make_groups(cases)
    agreement = _Agreement(device, rank)
    blocks = _blocks(cases)
    points = []
    for index, block in enumerate(blocks):
        if report is not None:
            first = block[0]
            report(f"{first.op} {first.level} x{len(first.ranks)}", index / len(blocks))
        budget_s = max(deadline_s - time.time(), 0.0) / (len(blocks) - index)
        points += _measure_block(block, options, groups[block[0].ranks], agreement, device, budget_s)
    dist.barrier()
    return points


def _blocks(cases: Sequence[_Case]) -> list[list[_Case]]:
    blocks: dict[tuple, list[_Case]] = {}
    for case in cases:
        blocks.setdefault((case.op, case.level, case.ranks), []).append(case)
    return list(blocks.values())


def _make_groups(cases: Sequence[_Case]) -> dict[tuple[int, ...], object]:
    """One process group per distinct rank set; every rank must create them, in the same order."""
    import torch.distributed as dist

    world = tuple(range(dist.get_world_size()))
    groups: dict[tuple[int, ...], object] = {}
    for ranks in sorted({case.ranks for case in cases}, key=lambda ranks: (len(ranks), ranks)):
        groups[ranks] = dist.group.WORLD if ranks == world else dist.new_group(list(ranks))
    return groups


class _Agreement:
    """All ranks of the default group agree on figures by taking the maximum: the slowest rank's
    time, and rank 0's budget (the others contribute 0)."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device, self.rank = device, rank

    def max(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()


def _measure_block(block: Sequence[_Case], options: ProfileOptions, group, agreement: _Agreement,
                   device: torch.device, budget_s: float) -> list[CollectivePoint]:
    """Median over rounds of the slowest member's per-call time, for each case of the block."""
    timer = Timer(options.device)
    is_member = agreement.rank in block[0].ranks
    calls = [_collective_call(case, group, device, agreement.rank) for case in block]
    warm_s = [_warm_collective_s(timer, call, options.warmup) if is_member else 0.0 for call, _ in calls]
    *warm_s, budget_s = agreement.max(warm_s + [budget_s if agreement.rank == 0 else 0.0])
    counts = [calls_for(once_s, options.min_sample_s, limit=1000) for once_s in warm_s]
    round_s = sum(once_s * count for once_s, count in zip(warm_s, counts))
    rounds = max(3, min(options.repeats, int(budget_s / max(round_s, 1e-9))))
    samples = [[0.0] * rounds for _ in block]
    if is_member:
        align = _aligner(group, device)
        for round_index in range(rounds):
            for case_samples, (call, _), count in zip(samples, calls, counts):
                align()
                case_samples[round_index] = timer.per_call_s(call, count)
    slowest = agreement.max([sample for case_samples in samples for sample in case_samples])
    points = []
    for index, (case, (_, message_bytes)) in enumerate(zip(block, calls)):
        time_s = statistics.median(slowest[index * rounds:(index + 1) * rounds])
        points.append(CollectivePoint(op=case.op, level=case.level, num_devices=len(case.ranks),
                                      message_bytes=float(message_bytes),
                                      time_s=time_s / 2 if case.op == "send_recv" else time_s))
    return points


def _warm_collective_s(timer: Timer, call: Callable[[], object], warmup: int) -> float:
    """Warm up and time two calls: fixed counts, since every member must issue the same calls."""
    for _ in range(warmup):
        call()
    return timer.per_call_s(call, 2)


def _aligner(group, device: torch.device) -> Callable[[], None]:
    """A barrier on `group` that works on gloo and NCCL (a one-element all-reduce, synchronized)."""
    import torch.distributed as dist

    token = torch.zeros(1, device=device)

    def align() -> None:
        dist.all_reduce(token, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return align


def _collective_call(case: _Case, group, device: torch.device, rank: int) -> tuple[Callable[[], object], int]:
    """The call to time (a no-op for non-members) and the message size it really moves, in the
    convention of comm.py. Buffers are zero-filled: sums stay finite, and pages are touched."""
    group_size = len(case.ranks)
    numel = max(group_size, round(case.message_bytes / 4 / group_size) * group_size)  # fp32
    if rank not in case.ranks:
        return (lambda: None), numel * 4
    return _member_call(case.op, numel, group_size, group, device, case.ranks, rank), numel * 4


def _member_call(op: str, numel: int, group_size: int, group, device: torch.device, ranks: tuple[int, ...],
                 rank: int) -> Callable[[], object]:
    import torch.distributed as dist

    def zeros(count: int) -> torch.Tensor:
        return torch.zeros(count, device=device)

    full = zeros(numel)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    if op == "send_recv":
        return _ping_pong(full, ranks, rank)
    if op == "all_to_all":
        received = zeros(numel)
        return lambda: dist.all_to_all_single(received, full, group=group)
    part = zeros(numel // group_size)
    if op == "all_gather":  # torch 2.13 renamed all_gather_into_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: all_gather(full, part, group=group)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: reduce_scatter(part, full, group=group)


def _ping_pong(buffer: torch.Tensor, ranks: tuple[int, ...], rank: int) -> Callable[[], None]:
    """First rank sends to the second and gets it back; the profile keeps half the round trip."""
    import torch.distributed as dist

    first, second = ranks[0], ranks[1]
    if rank == first:
        return lambda: (dist.send(buffer, second), dist.recv(buffer, second))
    if rank == second:
        return lambda: (dist.recv(buffer, first), dist.send(buffer, first))
    return lambda: None

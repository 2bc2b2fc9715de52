"""Run a function on N gloo processes of this machine and return rank 0's result.

    result = spawn(function, num_processes=4, args=(...,))

For `autopar profile --calibrate` and the benchmarks, which start their own processes (the
trials of `autopar tune` run inside the user's torchrun job instead). Each process gets the
environment torchrun would give it, one torch thread per core share, and joins a gloo group.
The result is written to a file before the process group is torn down, so that an abort while
the processes exit (gloo teardown) cannot lose it; such an exit is reported as a note.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from autopar.errors import ConfigError


class SpawnResult:
    """Rank 0's return value and how the processes ended."""

    def __init__(self, value, exit_codes: list[int]) -> None:
        self.value = value
        self.exit_codes = exit_codes

    @property
    def clean_exit(self) -> bool:
        return all(code == 0 for code in self.exit_codes)


def spawn(function: Callable, *, num_processes: int, args: tuple = (), timeout_s: float = 3600.0) -> SpawnResult:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="autopar-spawn-") as folder:
        port = _free_port()
        processes = [context.Process(target=_entry, args=(function, args, rank, num_processes, port, folder),
                                     name=f"autopar-rank{rank}") for rank in range(num_processes)]
        for process in processes:
            process.start()
        _wait(processes, timeout_s)
        codes = [process.exitcode if process.exitcode is not None else -9 for process in processes]
        outcome = Path(folder) / "rank0.pkl"
        errors = sorted(Path(folder).glob("error*.txt"))
        if errors:
            raise ConfigError(f"a process failed ({errors[0].stem}):\n{errors[0].read_text()[-3000:]}")
        if not outcome.exists():
            raise ConfigError(f"the {num_processes} processes ended (exit codes {codes}) without a result")
        return SpawnResult(pickle.loads(outcome.read_bytes()), codes)


def _wait(processes: list, timeout_s: float, grace_s: float = 20.0) -> None:
    """Wait for all; once one fails, the others get `grace_s` (they may be stuck in a collective
    with it); past the deadline the survivors are killed."""
    deadline = time.monotonic() + timeout_s
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        if any(process.exitcode not in (None, 0) for process in processes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    for process in processes:
        if process.is_alive():
            process.kill()  # only processes this call started
        process.join(5)


def _entry(function: Callable, args: tuple, rank: int, world_size: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo")
        value = function(*args)
        if rank == 0:
            path = Path(folder) / "rank0.pkl"
            path.with_suffix(".tmp").write_bytes(pickle.dumps(value))
            path.with_suffix(".tmp").rename(path)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported by the parent
        (Path(folder) / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

"""Does a finished gloo job exit 0? Torch alone, and with autopar's exit hook.

    .venv/bin/python benchmarks/exit_abort.py none 10      # torch alone: the script just ends
    .venv/bin/python benchmarks/exit_abort.py wait 10      # ... after waiting on its async works
    .venv/bin/python benchmarks/exit_abort.py destroy 10   # ... wait, barrier, destroy_process_group
    .venv/bin/python benchmarks/exit_abort.py autopar 10   # autopar.codegen.runtime's exit hook only

Each of N jobs spawns 4 processes that join gloo, build init_device_mesh("cpu", (1, 2, 2)), issue
one all_reduce(async_op=True) per mesh axis and an all_gather, then return. Printed: the jobs in
which some process exited non-zero (-6 is SIGABRT: "terminate called without an active exception").
"""

from __future__ import annotations

import os
import socket
import sys

import torch.multiprocessing as mp


def worker(rank: int, world_size: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    values = torch.ones(1000)
    works = [dist.all_reduce(values, group=mesh[axis].get_group(), async_op=True) for axis in ("pp", "dp", "tp")]
    gathered = [torch.empty(1000) for _ in range(world_size)]
    dist.all_gather(gathered, values)
    if mode in ("wait", "destroy"):
        for work in works:
            work.wait()
    if mode == "destroy":
        dist.barrier()
        dist.destroy_process_group()
    if mode == "autopar":
        from autopar.codegen.runtime import register_shutdown

        register_shutdown()


def main() -> None:
    mode, num_jobs = sys.argv[1], int(sys.argv[2])
    context = mp.get_context("spawn")
    failures = []
    for _ in range(num_jobs):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        processes = [context.Process(target=worker, args=(rank, 4, port, mode)) for rank in range(4)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(300)
        codes = [process.exitcode for process in processes]
        if any(codes):
            failures.append(codes)
    print(f"{mode}: {len(failures)}/{num_jobs} jobs with a process exiting non-zero: {failures}", flush=True)


if __name__ == "__main__":
    main()

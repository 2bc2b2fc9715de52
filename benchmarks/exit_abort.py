"""Does a finished gloo job exit 0? Torch alone, and with autopar's exit hook.

    .venv/bin/python benchmarks/exit_abort.py none 10      # torch alone: the script just ends
    .venv/bin/python benchmarks/exit_abort.py wait 10      # ... after waiting on its async works
    .venv/bin/python benchmarks/exit_abort.py destroy 10   # ... wait, barrier, destroy_process_group
    .venv/bin/python benchmarks/exit_abort.py autopar 10   # autopar.codegen.runtime's exit hook only
    .venv/bin/python benchmarks/exit_abort.py train 50     # an autopar dp=4 ZeRO-3 step, then the script's own destroy
    PYTHONPATH=. .venv/bin/python benchmarks/exit_abort.py kinds 50   # test_finished_jobs' 10 kinds of job, in turn

Each of N jobs spawns 4 processes that join gloo, build init_device_mesh("cpu", (1, 2, 2)), issue
one all_reduce(async_op=True) per mesh axis and an all_gather, then return. Printed: the jobs in
which some process exited non-zero (-6 is SIGABRT: "terminate called without an active exception").
`train` instead trains one step of a tiny GPT under autopar (dp=4, ZeRO-3) and ends as torchtitan's
scripts do, with its own dist.destroy_process_group() and no `with pm:`. `kinds` runs the jobs of
tests/dist/test_finished_jobs.py (exit_job.JOBS: ZeRO-3 with the script's own destroy on 4 and 2
processes, pm.steps with async checkpoints, pipelined plans that return, leave `with pm:` or close),
job i being JOBS[i % 10], each rank a `python exit_job.py` process as torchrun starts it; a job
also fails when a rank exited 0 without writing its result.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def worker(rank: int, world_size: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    if mode == "train":
        _train_then_destroy()
        return
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


def _train_then_destroy() -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models import build_model

    torch.set_num_threads(1)
    bundle = build_model("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0", device="meta", batch_size=8)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(bundle.model, "cpu:procs=4", (tokens,), loss_fn=bundle.loss_fn, example_targets=tokens,
                             constraints=dict(dp=4, tp=1, pp=1, zero_stage=3))
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.train_step((tokens,), tokens)
    optimizer.step()
    dist.destroy_process_group()


EXIT_JOB = Path(__file__).resolve().parents[1] / "tests" / "dist" / "exit_job.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _script_job(kind: str, world_size: int, folder: Path) -> list:
    """Exit codes of the ranks of one exit_job.py job; a rank that exited 0 without its result: "no result"."""
    port = _free_port()
    processes = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        processes.append(subprocess.Popen([sys.executable, str(EXIT_JOB), kind, str(folder)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    codes = []
    for rank, process in enumerate(processes):
        try:
            code = process.wait(300)
        except subprocess.TimeoutExpired:
            process.kill()  # only the ranks this call started
            code = process.wait()
        codes.append("no result" if code == 0 and not (folder / f"rank-{rank}.json").is_file() else code)
    return codes


def _kinds(num_jobs: int) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("exit_job", EXIT_JOB)
    exit_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exit_job)
    failures = []
    with tempfile.TemporaryDirectory() as root:
        for index in range(num_jobs):
            kind, world_size = exit_job.JOBS[index % len(exit_job.JOBS)]
            folder = Path(root) / f"job-{index}"
            folder.mkdir()
            codes = _script_job(kind, world_size, folder)
            if any(code != 0 for code in codes):
                failures.append((index, kind, world_size, codes))
    print(f"kinds: {len(failures)}/{num_jobs} jobs with a process exiting non-zero or without its result: "
          f"{failures}", flush=True)


def main() -> None:
    mode, num_jobs = sys.argv[1], int(sys.argv[2])
    if mode == "kinds":
        _kinds(num_jobs)
        return
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

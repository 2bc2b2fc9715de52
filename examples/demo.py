"""The autopar showcase (`make demo`).

1. Plan GPT-3 175B for 128 DGX-A100 nodes (1,024 GPUs) on this laptop-class CPU, and explain it.
2. Price Megatron-LM's hand-tuned configuration for a 39B GPT and let autopar search its own.
3. Train a tiny GPT on 4 CPU processes (gloo) with the plan autopar picks for 4 GPUs (slowed down
   so that a tiny model is worth splitting).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp

import autopar
from autopar import api


def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n{text}\n{'=' * 100}", flush=True)


def plan_gpt3() -> None:
    banner("1. GPT-3 175B on dgx-a100-80g:nodes=128 (1,024 A100 80GB), global batch 1536")
    started = time.perf_counter()
    plan = autopar.plan("gpt3-175b", cluster="dgx-a100-80g:nodes=128", global_batch=1536)
    print(plan.summary())
    print(f"\nplanned in {time.perf_counter() - started:.1f} s (capture of the 96-layer graph included)")


def megatron_comparison() -> None:
    banner("2. A 39.1B GPT on 512 A100s: Megatron-LM's published configuration vs autopar's plan")
    planner = api.planner_for("gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200", None,
                              "dgx-a100-80g:nodes=64", global_batch=1536)
    # Megatron-LM SC21, Table 1: tp=8, pp=2, microbatch 4, full recomputation.
    megatron = api.fixed_config(planner, tp=8, pp=2, dp=None, microbatch_size=4, schedule="1f1b",
                                virtual_stages=None, layers_per_virtual_stage=None, recompute="full", zero_stage=0)
    published = api.evaluate_with(planner, megatron)
    found = api.plan_with(planner)
    for label, plan in (("Megatron-LM (hand-tuned)", published), ("autopar (searched)", found)):
        mesh = plan.mesh
        print(f"{label:<26} tp={mesh['tp']} pp={mesh['pp']} dp={mesh['dp']} microbatch={plan.microbatch_size} "
              f"recompute={plan.recompute} zero={plan.zero_stage}: {plan.predicted.step_time_s:.2f} s/step, "
              f"{plan.model_tflops_per_device:.0f} model TFLOP/s per GPU, "
              f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB peak")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A DGX A100 whose GPUs compute 10^4 times slower: a tiny model is then as compute-bound as a
# large one is on real GPUs, so the planner splits it as it would split GPT-3 (on real A100
# figures a 64-wide model is all latency and the planner, rightly, only uses data parallelism).
SLOW_DGX = """preset = "dgx-a100-80g"
gpus_per_node = 4
[device]
fp32_tflops = 0.01
tf32_tflops = 0.01
bf16_tflops = 0.01
"""


def _train_worker(rank: int, world: int, port: int, steps: int, cluster: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from autopar.models import build_model

    bundle = build_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=96,dropout=0.0", device="cpu", seed=0,
                         batch_size=16)
    tokens = torch.randint(0, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    targets = (tokens + 1) % 96  # a pattern to learn: the next token is the current one plus one
    # Plain data parallelism would be fastest even here; tp=2 is fixed to show tensor parallelism.
    pm = autopar.parallelize(bundle.model, cluster, (tokens,), loss_fn=bundle.loss_fn, example_targets=targets,
                             constraints={"tp": 2})
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        print("\nrank 0 runs (first lines):\n" + "\n".join(pm.generated_code().splitlines()[:24]), flush=True)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    for step in range(steps):
        loss = pm.train_step((tokens,), targets)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    torch.distributed.destroy_process_group()


def train_tiny_gpt(steps: int = 8) -> None:
    banner("3. Training a tiny GPT on 4 CPU processes with the plan autopar makes for 4 (slowed-down) GPUs")
    with tempfile.TemporaryDirectory() as folder:
        cluster = os.path.join(folder, "slow-dgx.toml")
        with open(cluster, "w") as file:
            file.write(SLOW_DGX)
        mp.spawn(_train_worker, args=(4, _free_port(), steps, cluster), nprocs=4)


if __name__ == "__main__":
    plan_gpt3()
    megatron_comparison()
    train_tiny_gpt()

"""Train a tiny GPT with autopar: plan, parallelize, and run an ordinary training loop.

    .venv/bin/torchrun --nproc-per-node 4 examples/train_gpt.py
    .venv/bin/torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --steps 40
    .venv/bin/torchrun --nproc-per-node 2 examples/train_gpt.py --model gpt:layers=4,hidden=128,heads=4,seq=32

Every process runs this script. Rank 0 plans (the other ranks receive the plan), each rank builds
its share of the model, and the loop below is the same whether the plan is data, tensor or
pipeline parallel: `train_step` takes the global batch and leaves the gradients on
`pm.parameters()` for any optimizer.

The data is a fixed synthetic set with a learnable rule (the next token is the current one plus
one), so the loss visibly falls from ln(vocab) towards zero.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:layers=2,hidden=64,heads=4,seq=32,vocab=96,dropout=0.0",
                        help="built-in model spec (see `autopar models`)")
    # The planner prices the cluster it is given, not the machine it runs on. Without GPUs, the
    # default plans for as many A100s as there are processes: that shows the plan autopar would
    # run on a real DGX, and the same plan then runs here on CPU processes (gloo). (Planned for
    # this CPU, "cpu:procs=4", a model this small is simply data parallel.) With GPUs the default
    # is the matching GPU preset.
    parser.add_argument("--cluster", default=None,
                        help="cluster spec to plan for (default on CPU: dgx-a100-80g, one GPU per process)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--tp", type=int, default=None, help="force this tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=None, help="force this many pipeline stages")
    return parser.parse_args()


def synthetic_dataset(vocab: int, seq: int, batch: int, num_batches: int = 4):
    """Random token ids whose targets follow a rule: next token = (token + 1) % vocab."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(num_batches):
        tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
        batches.append((tokens, (tokens + 1) % vocab))
    return batches


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cluster = args.cluster or (None if torch.cuda.is_available() else f"dgx-a100-80g:gpus_per_node={world_size}")
    constraints = {key: value for key, value in (("tp", args.tp), ("pp", args.pp)) if value}

    bundle = build_model(args.model, device="cpu", seed=0, batch_size=args.global_batch)
    dataset = synthetic_dataset(bundle.config.vocab, bundle.config.seq, args.global_batch)
    tokens, targets = dataset[0]
    pm = autopar.parallelize(bundle.model, cluster, (tokens,), loss_fn=bundle.loss_fn, example_targets=targets,
                             constraints=constraints)
    rank = dist.get_rank()
    if rank == 0:
        print(pm.plan.summary(), flush=True)

    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    for step in range(args.steps):
        started = time.perf_counter()
        tokens, targets = dataset[step % len(dataset)]
        loss = pm.train_step((tokens,), targets)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({(time.perf_counter() - started) * 1e3:.0f} ms)",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

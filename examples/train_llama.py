"""Train a llama built on meta: plan, parallelize, per-rank data, checkpoints, resume under another plan.

    # 4 processes, dp2 x tp2; a checkpoint every 10 steps under ckpt/
    .venv/bin/torchrun --nproc-per-node 4 examples/train_llama.py --dp 2 --tp 2 --steps 20 --save-every 10
    # resume the last checkpoint under another plan (pp2 x tp2), or on 2 processes
    .venv/bin/torchrun --nproc-per-node 4 examples/train_llama.py --pp 2 --tp 2 --steps 40 --resume
    .venv/bin/torchrun --nproc-per-node 2 examples/train_llama.py --tp 2 --steps 40 --resume

The model is built on `meta`, so no process ever holds the whole model: `parallelize` gives each
rank storage for its own shards only and runs the model's `init_weights` on them (or loads the
checkpoint). Each rank reads only its data-parallel share of every batch (a DistributedSampler
over `pm.dp_size` replicas), gradients are clipped by the whole model's norm, and every
`--save-every` steps all ranks save one DCP checkpoint (model, optimizer, LR scheduler, step)
that any later plan can resume. Leaving the `with pm:` block ends the job in order (exit code 0).

The data is synthetic with a learnable rule (next token = current token + 1), so the loss falls.

`--elastic` runs the same training as a job that survives lost and added nodes (docs/guide.md,
"Elastic training"): `parallelize(..., checkpoint=, checkpoint_every=)` and `pm.steps(...)`.

    # two agents of 2 processes on one machine (run each line in its own shell); kill one, the
    # other goes on with 2 processes from the newest checkpoint; start it again to scale back to 4
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's shell lets it join: docs/guide.md)
    .venv/bin/torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        --rdzv-id demo --max-restarts 3 examples/train_llama.py --elastic --steps 200 --save-every 5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar
from autopar.models import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=176,seq=32,vocab=96",
                        help="built-in model spec (see `autopar models`)")
    parser.add_argument("--cluster", default=None,
                        help="cluster to plan for (default on CPU: one A100 per process, as train_gpt.py)")
    parser.add_argument("--steps", type=int, default=20, help="train until this step (counting resumed ones)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--checkpoints", default="ckpt", help="folder of step-N checkpoints")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--elastic", action="store_true",
                        help="elastic job: resume from --checkpoints, re-plan for the world torchrun gives")
    parser.add_argument("--step-log", default=None, help="--elastic: append each step's loss and samples (JSON lines)")
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="--elastic: a pause in each step (tests)")
    return parser.parse_args()


def synthetic_tokens(vocab: int, seq: int, num_sequences: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (num_sequences, seq), generator=generator)
    return TensorDataset(tokens, (tokens + 1) % vocab)


def newest_checkpoint(folder: Path) -> Path | None:
    steps = [path for path in folder.glob("step-*") if (path / ".metadata").is_file()]
    return max(steps, key=lambda path: int(path.name.split("-")[1]), default=None)


def elastic_main(args: argparse.Namespace) -> None:
    """The elastic pattern: a few lines more than a plain loop (docs/guide.md)."""
    torch.manual_seed(0)  # real weights, the same on every rank and in every plan (a resumed job loads its own)
    bundle = build_model(args.model, device="cpu", batch_size=args.global_batch)
    tokens, targets = synthetic_tokens(bundle.config.vocab, bundle.config.seq).tensors
    dataset = TensorDataset(tokens, targets, torch.arange(len(tokens)))  # the index: to show what was read
    pm = autopar.parallelize(bundle.model, args.cluster, (tokens[: args.global_batch],), loss_fn=bundle.loss_fn,
                             example_targets=targets[: args.global_batch], checkpoint=args.checkpoints,
                             checkpoint_every=args.save_every)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    attempt = torch.tensor([time.time_ns() % 2**62])  # this run of the job (the log tells restarts apart)
    dist.broadcast(attempt, src=0)
    for step, (batch_tokens, batch_targets, indices) in pm.steps(args.steps, dataset, optimizer=optimizer,
                                                                 scheduler=scheduler):
        loss = pm.train_step((batch_tokens,), batch_targets)
        pm.clip_grad_norm_(args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        time.sleep(args.step_sleep_s)
        if args.step_log:
            record = {"step": step, "loss": loss.item(), "world": dist.get_world_size(), "rank": dist.get_rank(),
                      "dp_rank": pm.dp_rank, "samples": indices.tolist(), "attempt": attempt.item()}
            with open(args.step_log, "a") as log:
                log.write(json.dumps(record) + "\n")
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({dist.get_world_size()} processes)", flush=True)
    dist.destroy_process_group()  # the usual ending; autopar waits for the peers first


def main() -> None:
    args = parse_args()
    if args.elastic:
        return elastic_main(args)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world_size = dist.get_world_size()
    cluster = args.cluster or (None if torch.cuda.is_available() else f"dgx-a100-80g:gpus_per_node={world_size}")
    constraints = {axis: value for axis, value in (("dp", args.dp), ("tp", args.tp), ("pp", args.pp)) if value}
    if constraints.get("pp", 1) > 1:
        constraints.setdefault("microbatch_size", max(args.global_batch // (2 * constraints["pp"]), 1))

    bundle = build_model(args.model, device="meta", batch_size=args.global_batch)
    dataset = synthetic_tokens(bundle.config.vocab, bundle.config.seq)
    example_tokens, example_targets = dataset[: args.global_batch]
    torch.manual_seed(0)  # the init's seed (parallelize shares rank 0's)
    pm = autopar.parallelize(bundle.model, cluster, (example_tokens,), loss_fn=bundle.loss_fn,
                             example_targets=example_targets, constraints=constraints)
    rank = dist.get_rank()
    with pm:
        optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
        step = 0
        checkpoint = newest_checkpoint(Path(args.checkpoints)) if args.resume else None
        if checkpoint is not None:
            extra = pm.load(checkpoint, optimizer=optimizer)
            scheduler.load_state_dict(extra["scheduler"])
            step = extra["step"]
        if rank == 0:
            print(pm.plan.summary(), flush=True)
            print(f"{'resumed ' + str(checkpoint) if checkpoint else 'initialised on meta'}; step {step}", flush=True)

        # Each data-parallel replica reads its own share; tensor/pipeline peers read the same one.
        sampler = DistributedSampler(dataset, num_replicas=pm.dp_size, rank=pm.dp_rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=args.global_batch // pm.dp_size, sampler=sampler, drop_last=True)
        epoch, skip = divmod(step, len(loader))  # a resumed run goes on where the saved one was
        while step < args.steps:
            sampler.set_epoch(epoch)
            for index, (tokens, targets) in enumerate(loader):
                if index < skip:
                    continue
                if step >= args.steps:
                    break
                started = time.perf_counter()
                loss = pm.train_step((tokens,), targets)
                norm = pm.clip_grad_norm_(args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
                if rank == 0:
                    print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}  "
                          f"({(time.perf_counter() - started) * 1e3:.0f} ms)", flush=True)
                if step % args.save_every == 0:
                    path = pm.save(Path(args.checkpoints) / f"step-{step}", optimizer=optimizer,
                                   extra={"step": step, "scheduler": scheduler.state_dict()})
                    if rank == 0:
                        print(f"saved {path}", flush=True)
            epoch, skip = epoch + 1, 0
        pm.eval()
        tokens, targets = next(iter(loader))
        loss = pm.eval_step((tokens,), targets)
        pm.train()
        if rank == 0:
            print(f"eval loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

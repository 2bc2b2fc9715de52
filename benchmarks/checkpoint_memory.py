"""Peak memory per rank of a meta-built model, and DCP checkpoint save / load times.

    .venv/bin/torchrun --nproc-per-node 4 benchmarks/checkpoint_memory.py --tp 4
    .venv/bin/torchrun --nproc-per-node 4 benchmarks/checkpoint_memory.py --dp 4 --zero-stage 3
    .venv/bin/torchrun --nproc-per-node 4 benchmarks/checkpoint_memory.py --tp 4 --real   # every rank builds it all

Every rank builds the llama on meta (or, with --real, with real weights on the CPU), parallelizes
it under the forced plan (planned for A100s, one per process, so that the plan is what those
would run), then trains one step with AdamW (so the optimizer state exists), saves a DCP
checkpoint of model and optimizer, and loads it back. Printed per rank: the peak resident set
size (ru_maxrss) after start-up (torch imported, process group joined), after parallelize, and at
the end; the bytes of parameters it holds; and the save and load times (the slowest rank's).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model

DEFAULT_MODEL = "llama:layers=24,hidden=1024,heads=16,kv_heads=8,ffn_hidden=2816,seq=128,vocab=32000"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--real", action="store_true", help="build real weights on every rank (the old way)")
    parser.add_argument("--folder", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    started_rss = peak_rss_bytes()
    bundle = build_model(args.model, device="cpu" if args.real else "meta", seed=0 if args.real else None,
                         batch_size=args.global_batch)
    num_params = sum(param.numel() for param in bundle.model.parameters())
    tokens = torch.randint(0, bundle.config.vocab, (args.global_batch, bundle.config.seq))
    targets = torch.randint(0, bundle.config.vocab, (args.global_batch, bundle.config.seq))
    constraints = dict(dp=args.dp, tp=args.tp, pp=args.pp, zero_stage=args.zero_stage, microbatch_size=1)
    begun = time.perf_counter()
    pm = autopar.parallelize(bundle.model, f"dgx-a100-80g:gpus_per_node={world}", (tokens,), loss_fn=bundle.loss_fn,
                             example_targets=targets, constraints=constraints, precision="fp32")
    parallelize_s = time.perf_counter() - begun
    after_parallelize_rss = peak_rss_bytes()
    held_bytes = sum((value.to_local() if hasattr(value, "to_local") else value).numel() * 4
                     for value in pm.state_dict().values())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    pm.train_step((tokens,), targets)
    optimizer.step()
    optimizer.zero_grad()

    folder = Path(args.folder or tempfile.mkdtemp(prefix="autopar-ckpt-")) if dist.get_rank() == 0 else None
    folder = Path(autopar_broadcast(str(folder) if folder else None))
    dist.barrier()
    begun = time.perf_counter()
    pm.save(folder / "step-1", optimizer=optimizer, extra={"step": 1})
    save_s = time.perf_counter() - begun
    begun = time.perf_counter()
    pm.load(folder / "step-1", optimizer=optimizer)
    load_s = time.perf_counter() - begun
    checkpoint_bytes = sum(path.stat().st_size for path in (folder / "step-1").iterdir())
    row = dict(rank=dist.get_rank(), start_rss_mib=started_rss / 2**20,
               after_parallelize_rss_mib=after_parallelize_rss / 2**20, end_rss_mib=peak_rss_bytes() / 2**20,
               held_param_mib=held_bytes / 2**20, parallelize_s=parallelize_s, save_s=save_s, load_s=load_s)
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        summary = dict(model=args.model, num_params=num_params, full_fp32_mib=num_params * 4 / 2**20,
                       plan=dict(pm.plan.mesh), zero_stage=pm.plan.zero_stage, real=args.real,
                       checkpoint_mib=checkpoint_bytes / 2**20,
                       save_s=max(r["save_s"] for r in rows), load_s=max(r["load_s"] for r in rows), ranks=rows)
        print(json.dumps(summary, indent=1), flush=True)
        if not args.folder:
            shutil.rmtree(folder, ignore_errors=True)
    pm.close()


def autopar_broadcast(value):
    from autopar.codegen.runtime import broadcast_object

    return broadcast_object(value)


if __name__ == "__main__":
    main()

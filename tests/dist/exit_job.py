"""One rank of a tiny autopar job that trains a step and ends (run by test_training's exit test).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python exit_job.py {atexit|with|close|destroy}

`atexit`: the script just ends (autopar's exit hook releases the job); `with`: leaves a `with pm:`
block; `close`: calls pm.close(); `destroy`: a ZeRO-3 data-parallel plan whose script ends as
torchtitan's do, with its own dist.destroy_process_group() (autopar makes it wait for the peers).
Prints "done" before it ends; the exit code must be 0."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model


def main(mode: str) -> None:
    torch.set_num_threads(1)
    bundle = build_model("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0", device="meta", batch_size=4)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    constraints = dict(dp=2, tp=1, pp=1, zero_stage=3) if mode == "destroy" else \
        dict(dp=1, tp=1, pp=2, microbatch_size=2)
    pm = autopar.parallelize(bundle.model, "cpu:procs=2", (tokens,), loss_fn=bundle.loss_fn,
                             example_targets=tokens, constraints=constraints)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    loss = pm.train_step((tokens,), tokens)
    optimizer.step()
    if mode == "with":
        with pm:
            pm.train_step((tokens,), tokens)
    elif mode == "close":
        pm.close()
    print(f"done {loss.item():.4f}", flush=True)
    if mode == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

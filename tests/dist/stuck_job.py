"""One rank of a job that trains until it is stopped (run by test_elastic's SIGSTOP test).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... AUTOPAR_COLLECTIVE_TIMEOUT_S=10 python stuck_job.py

Prints "step N" after each step; a peer that is SIGSTOPped makes this rank fail with autopar's
message naming it, within the collective timeout."""

from __future__ import annotations

import time

import torch

import autopar
from autopar.models import build_model


def main() -> None:
    torch.set_num_threads(1)
    bundle = build_model("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0", device="meta", batch_size=4)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(bundle.model, "cpu:procs=2", (tokens,), loss_fn=bundle.loss_fn,
                             example_targets=tokens, constraints=dict(dp=2, tp=1, pp=1))
    for step in range(1, 100_000):
        pm.train_step((tokens,), tokens)
        print(f"step {step}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()

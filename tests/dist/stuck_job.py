"""One rank of a job that trains until it is stopped (run by test_elastic's SIGSTOP tests).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... AUTOPAR_COLLECTIVE_TIMEOUT_S=10 python stuck_job.py

Each step runs train_step, clip_grad_norm_ and, with CHECKPOINT_DIR set, a checkpoint save, then
prints "step N". A peer that is SIGSTOPped makes this rank fail with autopar's message naming it,
within the collective timeout. STOP_BEFORE=clip (or save) makes rank 1 SIGSTOP itself at step 2
right before clip_grad_norm_ (or the save), so its peer waits in that phase's collective."""

from __future__ import annotations

import os
import signal
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
    stop_before, folder = os.environ.get("STOP_BEFORE", ""), os.environ.get("CHECKPOINT_DIR")
    for step in range(1, 100_000):
        pm.train_step((tokens,), tokens)
        _stop_if(stop_before == "clip", step)
        pm.clip_grad_norm_(1.0)
        if folder:
            _stop_if(stop_before == "save", step)
            pm.save(os.path.join(folder, f"step-{step}"))
        print(f"step {step}", flush=True)
        time.sleep(0.05)


def _stop_if(asked: bool, step: int) -> None:
    if asked and step == 2 and int(os.environ["RANK"]) == 1:
        print(f"stopping before step {step}'s next phase", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main()

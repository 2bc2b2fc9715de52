"""One rank of a tiny autopar job that trains and ends (run by test_finished_jobs and
benchmarks/exit_abort.py's `kinds`).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python exit_job.py KIND [RESULT_FOLDER]

KIND is how the script trains and ends (KINDS):
`atexit`: a pipelined plan (pp = 2) whose script just returns (autopar's exit hook releases the job);
`with`: leaves a `with pm:` block; `close`: calls pm.close();
`destroy`: a ZeRO-3 data-parallel plan (dp = WORLD_SIZE) whose script ends as torchtitan's do, with
its own dist.destroy_process_group() and no `with pm:` (autopar makes it wait for the peers);
`steps`: pm.steps over a dataset with asynchronous checkpoints (DCP async_save) every 2 of 4 steps
into RESULT_FOLDER/ckpt, then returns; `steps-destroy`: the same, ending with its own destroy.
With RESULT_FOLDER, each rank writes `rank-<R>.json` ({"kind", "losses"}) once it trained, before
it ends; it prints "done" too. The exit code must be 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import autopar
from autopar.models import build_model

KINDS = ("atexit", "with", "close", "destroy", "steps", "steps-destroy")
JOBS = [("destroy", 4), ("destroy", 2), ("steps", 2), ("atexit", 2), ("steps-destroy", 2),
        ("destroy", 2), ("with", 2), ("steps", 2), ("close", 2), ("atexit", 2)]
"""(kind, processes) of the 10 jobs of test_finished_jobs; exit_abort.py's `kinds` cycles through them."""
SPEC = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0"
GLOBAL_BATCH = 4
STEPS = 4
"""Steps of a `steps` job; it saves after steps 2 and 4."""
CHECKPOINT_EVERY = 2


def main(kind: str, result_folder: Path | None) -> None:
    if kind not in KINDS:
        print(f"unknown kind {kind!r}: use one of {', '.join(KINDS)}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    bundle = build_model(SPEC, device="meta", batch_size=GLOBAL_BATCH)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(0))
    constraints = dict(dp=1, tp=1, pp=2, microbatch_size=2) if kind in ("atexit", "with", "close") else \
        dict(dp=world, tp=1, pp=1, zero_stage=3)
    checkpoint = result_folder / "ckpt" if kind.startswith("steps") and result_folder else None
    pm = autopar.parallelize(bundle.model, f"cpu:procs={world}", (tokens,), loss_fn=bundle.loss_fn,
                             example_targets=tokens, constraints=constraints, checkpoint=checkpoint,
                             checkpoint_every=CHECKPOINT_EVERY)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = _steps(pm, optimizer) if kind.startswith("steps") else [_step(pm, optimizer, tokens)]
    if kind == "with":
        with pm:
            losses.append(_step(pm, optimizer, tokens))
    elif kind == "close":
        pm.close()
    if result_folder is not None:
        path = result_folder / f"rank-{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}.json"
        path.write_text(json.dumps({"kind": kind, "losses": losses}))
    print(f"done {losses[-1]:.4f}", flush=True)
    if kind.endswith("destroy"):
        dist.destroy_process_group()


def _step(pm, optimizer, tokens: torch.Tensor) -> float:
    loss = pm.train_step((tokens,), tokens)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def _steps(pm, optimizer) -> list[float]:
    samples = torch.randint(0, 64, (GLOBAL_BATCH * STEPS, 16), generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(samples, (samples + 1) % 64)
    losses = []
    for _, (inputs, targets) in pm.steps(STEPS, dataset, optimizer=optimizer):
        losses.append(float(pm.train_step((inputs,), targets).item()))
        optimizer.step()
        optimizer.zero_grad()
    return losses


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)

"""What checkpointing every N steps costs the step: pm.steps without checkpoints, with DCP's
async_save (the default) and with a synchronous save, on one process.

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_overhead.py            # every 50 steps
    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_overhead.py --every 10 --rounds 3

One module trains `--steps` steps per run; the three kinds of run alternate for `--rounds`
rounds (so that a change of the machine's load falls on all three). The time of a run is its
whole loop, the waits for the last save included. Printed: mean step time per kind, and the
overhead against the runs without checkpoints.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import autopar
from autopar.codegen.checkpoint import num_bytes
from autopar.codegen.training_loop import DEFAULT_CHECKPOINT_EVERY, CheckpointPolicy
from autopar.models import build_model

MODEL = "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn_hidden=704,seq=128,vocab=2048"


def run(pm, dataset, optimizer, steps: int, policy: CheckpointPolicy | None) -> float:
    """Seconds per step of one run of `steps` steps under `policy` (None: no checkpoints)."""
    pm.checkpointing = policy
    started = time.perf_counter()
    for _, (tokens, targets) in pm.steps(steps, dataset, optimizer=optimizer):
        pm.train_step((tokens,), targets)
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 3 x --every)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    steps = args.steps or 3 * args.every
    torch.manual_seed(0)
    bundle = build_model(args.model, device="cpu", batch_size=args.global_batch)
    tokens = torch.randint(0, bundle.config.vocab, (512, bundle.config.seq))
    dataset = TensorDataset(tokens, (tokens + 1) % bundle.config.vocab)
    pm = autopar.parallelize(bundle.model, "cpu:procs=1", (tokens[: args.global_batch],), loss_fn=bundle.loss_fn,
                             example_targets=dataset.tensors[1][: args.global_batch])
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    run(pm, dataset, optimizer, 5, None)  # warm-up: the optimizer's state exists before the first save
    state_bytes = num_bytes(pm.state_dict()) * 3  # weights and Adam's two moments
    times: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.rounds):
            for kind in times:
                policy = None if kind == "none" else CheckpointPolicy(
                    folder=Path(folder) / f"{kind}-{index}", every_steps=args.every, asynchronous=kind == "async")
                times[kind].append(run(pm, dataset, optimizer, steps, policy))
    base = statistics.mean(times["none"])
    print(f"{args.model}, batch {args.global_batch}, {state_bytes / 2**20:.0f} MiB of state, a checkpoint every "
          f"{args.every} steps, {steps} steps x {args.rounds} rounds")
    print("| checkpoints | step time (ms) | overhead |\n|---|---:|---:|")
    for kind, values in times.items():
        mean = statistics.mean(values)
        overhead = "-" if kind == "none" else f"{(mean - base) / base * 100:+.1f}%"
        print(f"| {kind} | {mean * 1e3:.1f} ({', '.join(f'{value * 1e3:.1f}' for value in values)}) | {overhead} |")


if __name__ == "__main__":
    main()

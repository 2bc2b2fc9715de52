"""What checkpointing every N steps costs the step: pm.steps without checkpoints, with DCP's
async_save (the default) and with a synchronous save, on one process.

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_overhead.py              # every 50 steps, 5 rounds
    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_overhead.py --every 10 --rounds 3

Each round runs the three kinds one after the other (the order rotates from round to round), each
a fresh pm.steps loop of (1 + --intervals) x --every steps in a new folder, so that a change of the
machine's load falls on all three. Two estimates of a kind's overhead, in % of the step time:
- per save (less noise): what the steps from the one that saved to the one that saw the checkpoint
  published took beyond the run's median step (the copy of the state; for async, also the steps
  the background write overlapped: its CPU and GIL), divided by `every` median steps. Median over
  the saves, spread (min..max). The last save of a run (waited for at the loop's end) is left out.
- per interval: the time from the start of step `every` to the start of step (1 + intervals) x
  every (whole checkpoint intervals; the steps before are the warm-up) against the run without
  checkpoints of the same round. Median over rounds, spread. One slow step of the machine moves
  it by its whole excess, which is why the other estimate exists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import autopar
from autopar.codegen.checkpoint import num_bytes
from autopar.codegen.training_loop import DEFAULT_CHECKPOINT_EVERY, CheckpointPolicy
from autopar.models import build_model

MODEL = "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn_hidden=704,seq=128,vocab=2048"
KINDS = ("none", "async", "sync")


@dataclass(frozen=True)
class Run:
    starts_s: list[float]
    """perf_counter at the start of each step's body."""
    published_at: dict[int, int]
    """For each save (its step), the first step at whose start its checkpoint was published."""


def run(pm, dataset, optimizer, every: int, intervals: int, policy: CheckpointPolicy | None) -> Run:
    """One pm.steps loop of (1 + intervals) x every steps under `policy` (None: no checkpoints)."""
    pm.checkpointing = policy
    starts, published, unpublished = [], {}, []
    for step, (tokens, targets) in pm.steps((1 + intervals) * every, dataset, optimizer=optimizer):
        starts.append(time.perf_counter())
        if policy is not None and step > every and (step - 1) % every == 0:
            unpublished.append(step - 1)  # saved after the previous step's body
        for saved in [saved for saved in unpublished if (policy.folder / f"step-{saved}").exists()]:
            published[saved] = step
            unpublished.remove(saved)
        pm.train_step((tokens,), targets)
        optimizer.step()
        optimizer.zero_grad()
    return Run(starts_s=starts, published_at=published)


def measure(pm, dataset, optimizer, args) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for index in range(args.rounds):
            for kind in KINDS[index % 3:] + KINDS[:index % 3]:
                policy = None if kind == "none" else CheckpointPolicy(
                    folder=Path(folder) / f"{kind}-{index}", every_steps=args.every, asynchronous=kind == "async")
                runs[kind].append(run(pm, dataset, optimizer, args.every, args.intervals, policy))
    return runs


def durations_s(one: Run) -> list[float]:
    """Duration of step i (1-based) at index i - 1, but for the last step."""
    return [later - earlier for earlier, later in zip(one.starts_s, one.starts_s[1:])]


def save_costs_s(one: Run, every: int) -> list[float]:
    """Per save: the time of its steps (the saving step up to the one that saw it published) beyond
    the run's median step of the others."""
    durations = durations_s(one)
    spans = [range(saved, published) for saved, published in one.published_at.items()]
    in_spans = {step for span in spans for step in span}
    median_s = statistics.median(value for step, value in enumerate(durations, 1) if step not in in_spans)
    return [sum(durations[step - 1] - median_s for step in span) for span in spans]


def window_s(one: Run, every: int, intervals: int) -> float:
    """Seconds from the start of step `every` to the start of step (1 + intervals) x every."""
    return one.starts_s[(1 + intervals) * every - 1] - one.starts_s[every - 1]


def report(runs: dict[str, list[Run]], args, state_bytes: int) -> None:
    step_s = statistics.median(value for one in runs["none"] for value in durations_s(one))
    print(f"{args.model}, batch {args.global_batch}, {state_bytes / 2**20:.0f} MiB of state, a checkpoint every "
          f"{args.every} steps; {args.rounds} rounds of {args.intervals} timed interval(s) per kind; "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load average (1 min) "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(f"median step without checkpoints: {step_s * 1e3:.1f} ms")
    print("| checkpoints | per save: cost (ms) | overhead | spread | steps it spans | "
          "per interval: overhead | spread |\n|---|---:|---:|---:|---:|---:|---:|")
    base = [window_s(one, args.every, args.intervals) for one in runs["none"]]
    for kind in KINDS[1:]:
        costs = [cost for one in runs[kind] for cost in save_costs_s(one, args.every)]
        spans = [published - saved for one in runs[kind] for saved, published in one.published_at.items()]
        per_save = [cost / (args.every * step_s) * 100 for cost in costs]
        windows = [(window_s(one, args.every, args.intervals) - none) / none * 100
                   for one, none in zip(runs[kind], base)]
        print(f"| {kind} | {statistics.median(costs) * 1e3:.0f} | {statistics.median(per_save):+.2f}% "
              f"| {min(per_save):+.2f}%..{max(per_save):+.2f}% | {statistics.median(spans):g} "
              f"| {statistics.median(windows):+.1f}% | {min(windows):+.1f}%..{max(windows):+.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    parser.add_argument("--intervals", type=int, default=1, help="timed checkpoint intervals per run (after one "
                        "interval of warm-up)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    parser.add_argument("--folder", default=None, help="where the checkpoints go (default: the temp folder)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bundle = build_model(args.model, device="cpu", batch_size=args.global_batch)
    tokens = torch.randint(0, bundle.config.vocab, (4096, bundle.config.seq))
    dataset = TensorDataset(tokens, (tokens + 1) % bundle.config.vocab)
    pm = autopar.parallelize(bundle.model, "cpu:procs=1", (tokens[: args.global_batch],), loss_fn=bundle.loss_fn,
                             example_targets=dataset.tensors[1][: args.global_batch])
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:  # warm-up: the optimizer's state, first saves
        for kind in ("async", "sync"):
            run(pm, dataset, optimizer, 2, 2, CheckpointPolicy(folder=Path(folder) / kind, every_steps=2,
                                                               asynchronous=kind == "async"))
    state_bytes = num_bytes(pm.state_dict()) * 3  # weights and Adam's two moments
    report(measure(pm, dataset, optimizer, args), args, state_bytes)


if __name__ == "__main__":
    main()

"""`pm.steps(...)`: a training loop that resumes where the newest complete checkpoint left off.

    pm = autopar.parallelize(model, None, example_inputs, loss_fn=loss_fn, checkpoint="ckpt/",
                             checkpoint_every=50)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=3e-4)
    for step, (tokens, targets) in pm.steps(1000, dataset, optimizer=optimizer, scheduler=scheduler):
        loss = pm.train_step((tokens,), targets)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

On entry every rank loads the newest complete checkpoint of the folder (`step-<N>` with DCP's
.metadata; a `.partial` one is a save that did not finish and is skipped): model, optimizer, LR
scheduler, rank 0's RNG state and the data position (the number of steps done; step_data.py).
Each iteration yields the step's number (1 for the first) and this rank's data-parallel share of
that step's global batch, collated; after the body, every `checkpoint_every` steps and after the
last one, the state is saved to `step-<N>`, asynchronously by default (DCP's async_save: the
step waits only for the copy of the state; the write of one checkpoint is waited for before the
next is started). Under torchrun with --nnodes MIN:MAX a restarted job (a node lost or added)
runs the script again on the new world: `parallelize` plans for it and `steps` reads on from the
checkpoint, so no sample is lost or read twice.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from autopar.codegen import checkpoint as checkpoints
from autopar.codegen.step_data import StepOrder
from autopar.errors import ConfigError

DEFAULT_CHECKPOINT_EVERY = 50
"""Steps between two checkpoints when `checkpoint=` is given without `checkpoint_every=`."""


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    folder: Path
    """Where the `step-<N>` checkpoints go (and are resumed from)."""
    every_steps: int = DEFAULT_CHECKPOINT_EVERY
    """Save after every this many steps (and after the last)."""
    asynchronous: bool = True
    """Write in a background thread (DCP async_save); False: the step waits for the write."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted by rank 0 once a newer one is published."""

    def __post_init__(self) -> None:
        if not isinstance(self.every_steps, int) or self.every_steps < 1:
            raise ConfigError(f"checkpoint_every must be a number of steps >= 1, got {self.every_steps!r}")
        if self.keep < 1:
            raise ConfigError(f"keep must be >= 1 checkpoint, got {self.keep}")


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete `step-<N>` checkpoint with the largest N, or None."""
    found = []
    for path in Path(folder).glob("step-*"):
        number = path.name[len("step-"):]
        if number.isdigit() and checkpoints.is_dcp_checkpoint(path):
            found.append((int(number), path))
    return max(found)[1] if found else None


def run_steps(pm, policy: CheckpointPolicy | None, total_steps: int, dataset, *, optimizer=None, scheduler=None,
              shuffle: bool = True, seed: int = 0, collate_fn=None):
    """The generator behind `ParallelModule.steps` (see the module docstring)."""
    order = StepOrder(num_samples=len(dataset), global_batch=pm.plan.global_batch, shuffle=shuffle, seed=seed)
    collate = collate_fn or default_collate
    done = _resume(pm, policy, order, optimizer, scheduler) if policy else 0
    pending = None
    while done < total_steps:
        indices = order.rank_indices(done, pm.dp_rank, pm.dp_size)
        yield done + 1, collate([dataset[index] for index in indices])
        done += 1
        if pending is not None and pending.done():  # published as soon as written, not at the next save
            _finish(pending, policy)
            pending = None
        if policy and (done % policy.every_steps == 0 or done == total_steps):
            if pending is not None:
                _finish(pending, policy)
            pending = _save(pm, policy, done, order, optimizer, scheduler)
    if pending is not None:
        _finish(pending, policy)


def _save(pm, policy: CheckpointPolicy, done: int, order: StepOrder, optimizer, scheduler):
    extra = {"step": done, "data": order.position(), "rng": torch.get_rng_state(),
             "world_size": dist.get_world_size(), "mesh": dict(pm.plan.mesh)}
    if scheduler is not None:
        extra["scheduler"] = scheduler.state_dict()
    result = checkpoints.save(pm, policy.folder / f"step-{done}", optimizer=optimizer, extra=extra,
                              asynchronous=policy.asynchronous)
    if not policy.asynchronous:
        _prune(policy)
        return None
    return result


def _finish(pending, policy: CheckpointPolicy) -> None:
    pending.finish()
    _prune(policy)


def _prune(policy: CheckpointPolicy) -> None:
    """Rank 0 deletes complete checkpoints older than the newest `keep`."""
    if dist.get_rank() != 0:
        return
    import shutil

    complete = sorted((int(path.name[5:]), path) for path in policy.folder.glob("step-*")
                      if path.name[5:].isdigit() and checkpoints.is_dcp_checkpoint(path))
    for _, path in complete[:-policy.keep]:
        shutil.rmtree(path, ignore_errors=True)


def _resume(pm, policy: CheckpointPolicy, order: StepOrder, optimizer, scheduler) -> int:
    """Load the newest complete checkpoint (the same on every rank: rank 0 picks it); steps done."""
    from autopar.codegen.runtime import broadcast_object

    newest = broadcast_object(newest_checkpoint(policy.folder) if dist.get_rank() == 0 else None)
    if newest is None:
        return 0
    extra = pm.load(newest, optimizer=optimizer)
    order.check_resumes(extra.get("data", {}), str(newest))
    if scheduler is not None:
        if "scheduler" not in extra:
            raise ConfigError(f"{newest} holds no LR scheduler state: resume without scheduler=, or from a "
                              "checkpoint saved with one")
        scheduler.load_state_dict(extra["scheduler"])
    if "rng" in extra:
        torch.set_rng_state(extra["rng"])
    if dist.get_rank() == 0:
        saved_world, world = extra.get("world_size"), dist.get_world_size()
        change = f"; saved by {saved_world} processes (mesh {extra.get('mesh')}), re-planned for {world} " \
                 f"(mesh {dict(pm.plan.mesh)})" if saved_world != world else ""
        print(f"autopar: resumed {newest} at step {extra['step']}{change}", file=sys.stderr, flush=True)
    return int(extra["step"])

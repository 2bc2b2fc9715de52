"""`pm.steps(...)`: a training loop that resumes where the newest complete checkpoint left off.

    pm = autopar.parallelize(model, None, example_inputs, loss_fn=loss_fn, checkpoint="ckpt/",
                             checkpoint_every=50)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=3e-4)
    for step, (tokens, targets) in pm.steps(1000, dataset, optimizer=optimizer, scheduler=scheduler):
        loss = pm.train_step((tokens,), targets)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

On entry every rank loads the newest complete checkpoint of the folder (`step-<N>` with DCP's
.metadata; a `.partial` one is a save that did not finish and is skipped): model, optimizer, LR
scheduler, the data position (the number of steps done; step_data.py) and the RNG states: every
rank's own (CPU, and the accelerator's), so that ranks whose streams differ (dropout under data
parallelism) draw what they would have; a job resumed on another number of ranks gives every
rank the state rank 0 saved.
Each iteration yields the step's number (1 for the first) and this rank's data-parallel share of
that step's global batch, collated; after the body, every `checkpoint_every` steps and after the
last one, the state is saved to `step-<N>`, asynchronously by default (DCP's async_save: the
step waits only for the copy of the state; the write of one checkpoint is waited for before the
next is started). A loop left early (break, an exception) waits for the write under way and
publishes it, or, if the write failed, deletes its `.partial` folder. Under torchrun with --nnodes MIN:MAX a restarted job (a node lost or added)
runs the script again on the new world: `parallelize` plans for it and `steps` reads on from the
checkpoint, so no sample is lost or read twice.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, default_collate

from autopar.codegen import checkpoint as checkpoints
from autopar.codegen import watchdog
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
    _check_indexable(dataset)
    order = StepOrder(num_samples=len(dataset), global_batch=pm.plan.global_batch, shuffle=shuffle, seed=seed)
    collate = collate_fn or default_collate
    done = _resume(pm, policy, order, optimizer, scheduler) if policy else 0
    pending = None
    try:
        while done < total_steps:
            indices = order.rank_indices(done, pm.dp_rank, pm.dp_size)
            yield done + 1, collate([dataset[index] for index in indices])
            done += 1
            if pending is not None and pending.done():  # published as soon as written, not at the next save
                pending = _finish(pending, policy)
            if policy and (done % policy.every_steps == 0 or done == total_steps):
                if pending is not None:
                    pending = _finish(pending, policy)
                pending = _save(pm, policy, done, order, optimizer, scheduler)
        if pending is not None:
            pending = _finish(pending, policy)
    finally:
        if pending is not None:  # the loop was left early: never leave a write half-done behind
            _settle(pending, policy)


def _check_indexable(dataset) -> None:
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"pm.steps reads samples by index (len(dataset), dataset[i]) so that a resumed job, on any "
                          f"number of replicas, reads on where the checkpoint left off; a {type(dataset).__name__} "
                          "has no index: pass a map-style dataset (a torch Dataset with __len__ and __getitem__), "
                          "or loop over your own loader calling pm.train_step and pm.save")


def _save(pm, policy: CheckpointPolicy, done: int, order: StepOrder, optimizer, scheduler):
    with watchdog.watched(pm.num_train_steps, "checkpoint save"):
        states = _rng_by_rank(pm)
    extra = {"step": done, "data": order.position(), "rng": torch.get_rng_state(), **states,
             "world_size": dist.get_world_size(), "mesh": dict(pm.plan.mesh)}
    if scheduler is not None:
        extra["scheduler"] = scheduler.state_dict()
    result = checkpoints.save(pm, policy.folder / f"step-{done}", optimizer=optimizer, extra=extra,
                              asynchronous=policy.asynchronous)
    if not policy.asynchronous:
        _prune(policy)
        return None
    return result


def _rng_by_rank(pm) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, one row per rank: the CPU generator's, and the accelerator's."""
    mine = {"rng_by_rank": torch.get_rng_state()}
    device = pm.runtime.device
    if device.type == "cuda":
        mine["device_rng_by_rank"] = torch.cuda.get_rng_state(device)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {key: torch.stack([row[key] for row in rows]) for key in mine}


def _restore_rng(pm, extra: dict) -> None:
    """This rank's own saved RNG states when the world is the one that saved them; else rank 0's."""
    by_rank = extra.get("rng_by_rank")
    if by_rank is None:  # saved before every rank's state was: one rank's state
        if "rng" in extra:
            torch.set_rng_state(extra["rng"])
        return
    row = dist.get_rank() if by_rank.shape[0] == dist.get_world_size() else 0
    torch.set_rng_state(by_rank[row].clone())
    device_states = extra.get("device_rng_by_rank")
    if device_states is not None and pm.runtime.device.type == "cuda":
        torch.cuda.set_rng_state(device_states[row].clone(), pm.runtime.device)


def _finish(pending, policy: CheckpointPolicy) -> None:
    """Wait for an asynchronous save and publish it; None (no save pending any more)."""
    pending.finish()
    _prune(policy)


def _settle(pending, policy: CheckpointPolicy) -> None:
    """Finish the save under way of a loop left early, or (its write failed) delete its staging
    folder, so that no `.partial` write is left to a later job (which would never load it anyway)."""
    import shutil

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _finish(pending, policy)
    except (Exception, CheckpointException) as error:  # the loop's own exception, if any, is the one raised
        if dist.get_rank() == 0:
            shutil.rmtree(pending.staging, ignore_errors=True)
        print(f"autopar: the checkpoint {pending.target} being written when the loop was left was discarded: "
              f"{str(error).splitlines()[0][:200] if str(error) else type(error).__name__}", file=sys.stderr, flush=True)


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
    _restore_rng(pm, extra)
    if dist.get_rank() == 0:
        saved_world, world = extra.get("world_size"), dist.get_world_size()
        change = f"; saved by {saved_world} processes (mesh {extra.get('mesh')}), re-planned for {world} " \
                 f"(mesh {dict(pm.plan.mesh)})" if saved_world != world else ""
        print(f"autopar: resumed {newest} at step {extra['step']}{change}", file=sys.stderr, flush=True)
    return int(extra["step"])

"""A stuck peer named: which rank stopped answering, in which collective of which step.

torch's collectives fail after the process group's timeout (autopar starts its groups with
`runtime.collective_timeout_s()`, 300 s unless AUTOPAR_COLLECTIVE_TIMEOUT_S says otherwise), but
gloo's message names neither the peer nor the operation ("Timed out waiting 60000ms for recv
operation to complete"). Each rank therefore records in the job's store (torchrun's agent's, or
worker rank 0's when the store is not shared or there is no torchrun) the step and phase it
entered; when a collective fails, the rank reads every rank's place and names those that are
behind it, with the phase they were in, and torch's own message. The phases, in a step's order:
train_step's forward and backward (tensor/pipeline/FSDP collectives), gradient sync (the data-
parallel reduction) and loss all-reduce, then `clip_grad_norm_`'s all-reduce (gradient clipping)
and a checkpoint save's barriers and DCP collectives (checkpoint save), both counted in the step
of the last train_step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from autopar.errors import AutoparError

_KEY = "autopar/progress/{rank}"
_READ_TIMEOUT = timedelta(seconds=5)
PHASES = ("forward and backward", "gradient sync", "loss all-reduce", "gradient clipping", "checkpoint save")
"""A step's phases in order; each rank records the one it enters."""
TRAIN_STEP_PHASES = PHASES[:3]
"""The phases inside train_step; the others follow it (clip_grad_norm_, a checkpoint save)."""


class PeerStoppedError(AutoparError):
    """A collective of a step failed: a peer stopped answering or died."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def record(step: int, phase: str) -> None:
    """Say in the job's store that this rank entered `phase` of step `step` (1-based; 0 before the
    first train_step)."""
    store = _store()
    if store is not None and dist.get_world_size() > 1:
        store.set(_KEY.format(rank=dist.get_rank()), str(step * len(PHASES) + PHASES.index(phase)))


def progress() -> dict[int, int]:
    """Every rank's recorded (step, phase) as one number; 0: none recorded, -1: no answer (a store
    that does not answer for one rank is not asked for the others: one timeout, not one per rank)."""
    store = _store()
    world = dist.get_world_size()
    counts = {}
    for rank in range(world):
        key = _KEY.format(rank=rank)
        try:
            store.set_timeout(_READ_TIMEOUT)
            counts[rank] = int(store.get(key)) if store.check([key]) else 0
        except (RuntimeError, ValueError):
            return {**counts, **{other: -1 for other in range(rank, world)}}
    return counts


_FAILURE_MARKERS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "gloo", "nccl")


def is_collective_failure(error: BaseException) -> bool:
    """torch's error of a collective that failed on its peers (not a shape or type error); DCP's
    CheckpointException carries each rank's failure in its text."""
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


def _where(value: int) -> str:
    step, phase = divmod(value, len(PHASES))
    return f"step {step}, {PHASES[phase]}" if value > 0 else "no step yet"


def _operation(step: int, phase: str) -> str:
    if phase in TRAIN_STEP_PHASES:
        return f"train_step {step} ({phase})"
    return f"{phase} after train_step {step}" if step else f"{phase} before the first train_step"


@contextmanager
def watched(step: int, phase: str) -> Iterator[None]:
    """Record that this rank entered `phase` of `step` and run the phase's collectives so that
    their failure (a RuntimeError, or DCP's CheckpointException) names the rank behind."""
    try:
        record(step, phase)  # inside: a store that stopped answering (served by a stopped rank 0) fails here
        yield
    except PeerStoppedError:
        raise
    except (RuntimeError, CheckpointException) as error:
        if not is_collective_failure(error):
            raise
        raise diagnosis(error, step=step, phase=phase) from error


def diagnosis(error: Exception, *, step: int, phase: str) -> PeerStoppedError:
    """The error to raise in place of `error`, a collective's failure in `phase` of `step`.
    A rank counts as behind when its recorded place is before `phase` of `step`."""
    counts = progress() if _store() is not None else {}
    me = dist.get_rank()
    mine = step * len(PHASES) + PHASES.index(phase)
    behind = sorted(rank for rank, count in counts.items() if 0 <= count < mine and rank != me)
    silent = sorted(rank for rank, count in counts.items() if count < 0 and rank != me)
    if behind:
        culprit = "; ".join(f"rank {rank} stopped answering (its last recorded place: {_where(counts[rank])})"
                            for rank in behind)
    elif silent:
        culprit = f"the job's store did not answer for rank(s) {silent}"
    else:
        culprit = "every rank came to this phase: a peer stopped answering (or died) inside its collective"
    said = str(error).strip().splitlines()
    return PeerStoppedError(f"rank {me}: a collective of {_operation(step, phase)} failed: {culprit}. torch said: "
                            f"{(said[0] if said else type(error).__name__)[:300]}. The job fails instead of waiting "
                            "forever; under torchrun it restarts from the newest checkpoint (docs/guide.md, "
                            "Elastic training)")

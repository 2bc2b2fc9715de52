"""A stuck peer named: which rank stopped answering, in which collective of which step.

torch's collectives fail after the process group's timeout (autopar starts its groups with
`runtime.collective_timeout_s()`, 300 s unless AUTOPAR_COLLECTIVE_TIMEOUT_S says otherwise), but
gloo's message names neither the peer nor the operation ("Timed out waiting 60000ms for recv
operation to complete"). Each rank therefore records in the job's store (torchrun's, which lives
in the agent, not in a worker) the step and phase of train_step it entered; when a collective of
a step fails, the rank reads every rank's place and names those that are behind it, with the
phase it was in (forward and backward: tensor/pipeline/FSDP collectives; gradient sync: the data-
parallel reduction; loss: the all-reduce of the mean loss) and torch's own message.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from autopar.errors import AutoparError

_KEY = "autopar/progress/{rank}"
_READ_TIMEOUT = timedelta(seconds=5)
PHASES = ("forward and backward", "gradient sync", "loss all-reduce")
"""A train_step's phases in order; each rank records the one it enters."""


class PeerStoppedError(AutoparError):
    """A collective of train_step failed: a peer stopped answering or died."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def record(step: int, phase: str) -> None:
    """Say in the job's store that this rank entered `phase` of train_step `step` (1-based)."""
    store = _store()
    if store is not None and dist.get_world_size() > 1:
        store.set(_KEY.format(rank=dist.get_rank()), str(step * len(PHASES) + PHASES.index(phase)))


def progress() -> dict[int, int]:
    """Every rank's recorded (step, phase) as one number; 0: none recorded, -1: no answer."""
    store = _store()
    counts = {}
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank=rank)
        try:
            store.set_timeout(_READ_TIMEOUT)
            counts[rank] = int(store.get(key)) if store.check([key]) else 0
        except (RuntimeError, ValueError):
            counts[rank] = -1
    return counts


_FAILURE_MARKERS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "gloo", "nccl")


def is_collective_failure(error: BaseException) -> bool:
    """torch's error of a collective that failed on its peers (not a shape or type error)."""
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


def _where(value: int) -> str:
    step, phase = divmod(value, len(PHASES))
    return f"step {step}, {PHASES[phase]}" if value > 0 else "no step yet"


def diagnosis(error: Exception, *, step: int, phase: str) -> PeerStoppedError:
    """The error to raise in place of `error`, a collective's failure in `phase` of `step`."""
    counts = progress() if _store() is not None else {}
    me = dist.get_rank()
    mine = step * len(PHASES) + PHASES.index(phase)
    behind = sorted(rank for rank, count in counts.items() if 0 <= count < mine)
    silent = sorted(rank for rank, count in counts.items() if count < 0)
    if behind:
        culprit = "; ".join(f"rank {rank} stopped answering (its last recorded place: {_where(counts[rank])})"
                            for rank in behind)
    elif silent:
        culprit = f"the job's store did not answer for rank(s) {silent}"
    else:
        culprit = "every rank came to this phase: a peer stopped answering (or died) inside its collective"
    said = str(error).strip().splitlines()
    return PeerStoppedError(f"rank {me}: a collective of train_step {step} ({phase}) failed: {culprit}. torch said: "
                            f"{(said[0] if said else type(error).__name__)[:300]}. The job fails instead of waiting "
                            "forever; under torchrun it restarts from the newest checkpoint (docs/guide.md, "
                            "Elastic training)")

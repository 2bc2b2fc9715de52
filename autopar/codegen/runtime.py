"""Process groups, the device mesh, and agreement between ranks.

`parallelize` runs on every rank of a torchrun job (or of processes started by
torch.multiprocessing). Rank 0 plans and broadcasts the plan; every check that can fail is
made on every rank with the same inputs, or its outcome is shared, so that a bad input stops
all ranks with the same message instead of leaving some waiting in a collective.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import AutoparError, PlanMismatchError

MESH_AXES = ("pp", "dp", "tp")
CP_MESH_AXES = ("pp", "dp", "cp", "tp")
"""With context parallelism: cp between dp and tp (tp fastest), as the planner lays it out."""


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    """(pp, dp, tp) over all ranks, tp fastest."""
    experts: DeviceMesh | None = None
    """With expert parallelism: (pp, dp_rep, [cp,] tp, ep) over the same ranks, where dp = dp_rep x ep
    with ep fastest (codegen/experts.py, expert_device_mesh); None without."""

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The (tp, ep) mesh expert weights are placed on."""
        return self.experts["tp", "ep"]

    @property
    def ep_group(self):
        return self.experts["ep"].get_group()

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts (FSDP's mesh for expert weights under ZeRO-1/2/3):
        dp_rep, or dp_rep x cp flattened."""
        if "cp" not in self.experts.mesh_dim_names:
            return self.experts["dp_rep"]
        if not hasattr(self, "_expert_replica_mesh"):
            self._expert_replica_mesh = self.experts["dp_rep", "cp"]._flatten("dp_rep_cp")
        return self._expert_replica_mesh

    @property
    def expert_replica_group(self):
        """The ranks holding the same experts (over which their gradients are reduced)."""
        return self.expert_replica_mesh.get_group()

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    def coordinate(self, axis: str) -> int:
        return self.mesh[axis].get_local_rank()

    @property
    def cp_group(self):
        return self.mesh["cp"].get_group()

    @property
    def reduce_mesh(self) -> DeviceMesh:
        """The ranks that hold the same parameters: dp, or dp x cp flattened (FSDP's mesh, the
        gradient all-reduce's group)."""
        if "cp" not in (self.mesh.mesh_dim_names or ()):
            return self.dp_mesh
        if not hasattr(self, "_reduce_mesh"):
            self._reduce_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        return self._reduce_mesh


DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""How long a collective may wait for a peer before it fails (the process groups autopar starts;
AUTOPAR_COLLECTIVE_TIMEOUT_S overrides it). torch's own default is 30 minutes (gloo) or 10
(NCCL): a stopped rank would hold its peers that long."""


def collective_timeout_s() -> float:
    value = os.environ.get("AUTOPAR_COLLECTIVE_TIMEOUT_S")
    try:
        seconds = float(value) if value else DEFAULT_COLLECTIVE_TIMEOUT_S
    except ValueError:
        raise AutoparError(f"AUTOPAR_COLLECTIVE_TIMEOUT_S={value!r} is not a number of seconds: "
                           "set it to e.g. 60, or unset it") from None
    if not seconds > 0:
        raise AutoparError(f"AUTOPAR_COLLECTIVE_TIMEOUT_S={value!r} must be > 0 seconds")
    return seconds


def ensure_process_group() -> tuple[int, int]:
    """Join the torchrun job (env://), or start a one-process group when run standalone; the
    groups autopar starts time out after `collective_timeout_s()`."""
    if not dist.is_initialized():
        from datetime import timedelta

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = timedelta(seconds=collective_timeout_s())
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def factories_on(graph, device: torch.device) -> None:
    """A model traced on meta (born there, or the compute-dtype replica of capture/compute_dtype.py)
    bakes `meta` into the tensors its forward makes or moves (`torch.ones(n, device=x.device)`,
    `inv_freq.to(x.device)`): make them on this rank's `device` instead."""
    from torch.fx.node import map_aggregate

    def here(value):
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = map_aggregate(node.args, here), map_aggregate(node.kwargs, here)


def build_runtime(mesh_sizes: dict[str, int], ep: int = 1, *, folded: bool = False) -> Runtime:
    """`folded`: MoE parallel folding (etp = 1 with tp > 1): the ep groups drawn from the tp x dp
    ranks (`folded_expert_device_mesh`), else from the dp ranks."""
    rank, world = ensure_process_group()
    axes = CP_MESH_AXES if mesh_sizes.get("cp", 1) > 1 else MESH_AXES
    shape = tuple(mesh_sizes[axis] for axis in axes)
    if math.prod(shape) != world:
        raise PlanMismatchError(f"the plan's mesh {' x '.join(axes)} = {shape} needs {math.prod(shape)} "
                                f"processes, but the job has {world}: launch that many or re-plan")
    device = local_device()
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=axes)
    experts = None
    if ep > 1:
        experts = folded_expert_device_mesh(device.type, shape, ep) if folded else \
            expert_device_mesh(device.type, shape, ep)
    return Runtime(rank=rank, world_size=world, device=device, mesh=mesh, experts=experts)


def expert_device_mesh(device_type: str, shape: tuple[int, ...], ep: int) -> DeviceMesh:
    """The ranks of the (pp, dp, tp) or (pp, dp, cp, tp) mesh as (pp, dp_rep, [cp,] tp, ep), where
    dp = dp_rep x ep with ep fastest: an expert group is ep consecutive dp ranks of the same cp
    and tp index (each cp rank exchanges the tokens of its own sequence shard)."""
    pp, dp, *rest = shape
    ranks = torch.arange(math.prod(shape)).reshape(pp, dp // ep, ep, *rest)
    order = (0, 1, *range(3, 3 + len(rest)), 2)  # ep last
    names = ("pp", "dp_rep", "cp", "tp", "ep") if len(rest) == 2 else ("pp", "dp_rep", "tp", "ep")
    return DeviceMesh(device_type, ranks.permute(order), mesh_dim_names=names)


def folded_expert_device_mesh(device_type: str, shape: tuple[int, ...], ep: int) -> DeviceMesh:
    """MoE parallel folding: the ranks of the (pp, dp, tp) mesh as (pp, dp_rep, tp, ep) with a tp
    dim of size 1 (expert weights are not split by tp) and ep consecutive ranks of the (dp, tp)
    grid (tp innermost) an expert group; dp_rep = dp x tp / ep ranks hold the same experts."""
    return DeviceMesh(device_type, folded_expert_ranks(shape, ep), mesh_dim_names=("pp", "dp_rep", "tp", "ep"))


def folded_expert_ranks(shape: tuple[int, ...], ep: int) -> torch.Tensor:
    """The ranks of `folded_expert_device_mesh`, (pp, dp_rep, 1, ep)."""
    pp, *rest = shape
    return torch.arange(math.prod(shape)).reshape(pp, math.prod(rest) // ep, 1, ep)


def broadcast_object(value, src: int = 0):
    """Send a picklable value from `src` to every rank."""
    if dist.get_world_size() == 1:
        return value
    holder = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def run_on_rank0(function):
    """Run `function` on rank 0 and share its result, or its error, with every rank."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", function())
        except Exception as error:  # any error, not only AutoparError: the other ranks wait in the broadcast
            outcome = ("error", error)
    kind, value = broadcast_object(outcome)
    if kind == "error":
        raise value
    return value


def agree(error: AutoparError | None) -> None:
    """Raise on every rank if any rank hit an error (the first rank's message wins)."""
    if dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((item for item in errors if item is not None), None)
    if first is not None:
        raise first


# --- shutdown ----------------------------------------------------------------------------------

_SHUTDOWN_BARRIER_TIMEOUT_S = 300.0
"""How long a finished rank waits at exit for its peers to finish too (then ends anyway)."""

_state = {"registered": False, "failed": False}


def shutdown() -> None:
    """End this rank's part of the job in order, once: (1) wait until every rank got here, so no
    peer is still sending to us or waiting for us in a collective; (2) destroy every process
    group (the device mesh's sub-groups and the world group) while the interpreter is whole, so
    gloo's worker threads are joined by their owners instead of being torn down in whatever
    order the interpreter frees objects at exit. A no-op when no process group is left."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1 and not _state["failed"]:
        _barrier_with_timeout()
    from torch.distributed import distributed_c10d

    original = getattr(distributed_c10d.destroy_process_group, "__wrapped__", distributed_c10d.destroy_process_group)
    original()


def _barrier_with_timeout() -> None:
    from datetime import timedelta

    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=_SHUTDOWN_BARRIER_TIMEOUT_S))
        else:
            dist.barrier()
    except RuntimeError:
        pass  # a peer failed or left: nothing to wait for, still release our groups


def register_shutdown() -> None:
    """Run `shutdown` at interpreter exit, unless the script failed (its peers may never arrive),
    and make the script's own `dist.destroy_process_group()` of the whole job wait for its
    peers first (`_orderly_destroy`)."""
    if _state["registered"]:
        return
    import atexit
    import sys

    _wrap_destroy_process_group()

    previous_hook = sys.excepthook

    def mark_failed(*info):
        _state["failed"] = True
        previous_hook(*info)

    sys.excepthook = mark_failed
    atexit.register(_shutdown_at_exit)
    _state["registered"] = True


def _shutdown_at_exit() -> None:
    if not _state["failed"]:
        shutdown()


def _wrap_destroy_process_group() -> None:
    """Scripts end with their own `dist.destroy_process_group()` (torchtitan's do). Called
    straight away, a rank that finished first tears its gloo pairs down while a peer may still be
    using them, and now and then a rank aborts at exit (SIGABRT, "terminate called without an
    active exception"; see `_orderly_destroy`). torch offers no hook before a destroy, so the
    function is replaced in both places scripts reach it from; a destroy of one subgroup is passed
    through unchanged."""
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_autopar_orderly", False):
        return

    def destroy_process_group(group=None):
        if group is None or group is distributed_c10d.GroupMember.WORLD:
            _orderly_destroy(original)
        else:
            original(group)

    destroy_process_group._autopar_orderly = True
    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group.__wrapped__ = original
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _orderly_destroy(original) -> None:
    """Wait (bounded) until every rank has come to its destroy, so no peer is still sending to us
    or waiting for us, then destroy every group, as `shutdown` does at exit."""
    if dist.is_initialized() and dist.get_world_size() > 1 and not _state["failed"]:
        _barrier_with_timeout()
    original()

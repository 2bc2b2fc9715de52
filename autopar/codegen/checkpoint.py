"""Checkpoints with torch.distributed.checkpoint (DCP), independent of the plan.

    pm.save("ckpt/step-100", optimizer=optimizer, extra={"step": 100})
    extra = pm.load("ckpt/step-100", optimizer=optimizer)     # under any plan, any world size

Model entries are keyed by the original model's parameter (and persistent buffer) names and
hold full-shape tensors: DTensors for tensor-parallel and FSDP shards, plain tensors for
replicas. DCP stores each shard once with its offsets in the full tensor and, on load, reads
for every rank exactly the region its own shards cover, so a checkpoint saved under one mesh
(dp2 x tp2) loads under another (pp2 x tp2), or on another number of processes, as torchtitan
resumes jobs. The optimizer state comes from `torch.distributed.checkpoint.state_dict` in its
flattened form ("state.<param>.<key>", "param_groups.<param>.<key>", which is what makes a
pipeline rank's partial optimizer loadable elsewhere), with the rank-local parameter names
renamed to the original ones.

Writes are atomic: DCP writes into `<name>.partial` next to the target, and only after every
rank finished does rank 0 rename it to `<name>` (replacing an older checkpoint of that name).
DCP's `.metadata` file marks a complete checkpoint; a folder without one is refused.

Hugging Face safetensors files (a `.safetensors` file or a folder of them) load through DCP's
`HuggingFaceStorageReader`, which also reads only this rank's slices.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from autopar.codegen import checkpoint_extra, watchdog
from autopar.errors import AutoparError

_METADATA = ".metadata"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(AutoparError):
    """A checkpoint that cannot be saved or loaded as asked."""


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / _METADATA).is_file()


def save(module, path: str | Path, *, optimizer=None, extra: dict | None = None, asynchronous: bool = False):
    """Save the model (and optimizer) state of every rank to `path`, atomically; returns `path`,
    or with `asynchronous` a PendingSave once the state is copied (DCP's async_save), whose
    `finish()` every rank calls before the next save."""
    try:  # before any collective: every rank refuses the same extra at once
        stored_extra = checkpoint_extra.encode(extra) if extra is not None else None
    except checkpoint_extra.ExtraError as error:
        raise CheckpointError(f"cannot save {path}: {error}") from None
    # a peer that stops answering in the save's collectives fails it naming the peer (watchdog.py)
    with watchdog.watched(_step_of(module), "checkpoint save"):
        return _save(module, Path(path), optimizer, stored_extra, asynchronous)


def _step_of(module) -> int:
    return getattr(module, "num_train_steps", 0)


def _save(module, target: Path, optimizer, stored_extra, asynchronous: bool):
    staging = target.with_name(target.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a job that died while saving
        staging.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": module.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(module, optimizer)
    if stored_extra is not None:  # JSON (DCP would flatten nested dicts) and its tensors as DCP entries
        state[checkpoint_extra.JSON_KEY], state[checkpoint_extra.TENSORS_KEY] = stored_extra
    if asynchronous:
        group = _async_group()
        future = dcp.async_save(state, checkpoint_id=str(staging), process_group=group)
        return PendingSave(target=target, staging=staging, future=future, rank=rank, module=module)
    dcp.save(state, checkpoint_id=str(staging))
    dist.barrier()
    if rank == 0:
        _publish(staging, target)
    dist.barrier()
    return target


def _publish(staging: Path, target: Path) -> None:
    """Rename a finished `<name>.partial` to `<name>` (replacing an older one of that name)."""
    previous = target.with_name(target.name + ".old")
    if target.exists():
        shutil.rmtree(previous, ignore_errors=True)
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


@dataclass
class PendingSave:
    """An asynchronous save under way: its tensors are copied (staged) already, a thread writes
    them. `finish()` waits for the write and publishes the checkpoint (rank 0 renames it)."""

    target: Path
    staging: Path
    future: object
    rank: int
    module: object
    """The module saved: its step count names the place of a failed write (watchdog.py)."""

    def done(self) -> bool:
        return self.future.done()

    def finish(self) -> Path:
        """Wait for this rank's write. DCP's coordinator (rank 0 of the save's group) writes the
        .metadata file only after every rank reported its write, so when rank 0's write is done the
        whole checkpoint is on disk and rank 0 alone renames it: no barrier of the training ranks."""
        with watchdog.watched(_step_of(self.module), "checkpoint save"):
            self.future.result()
        if self.rank == 0 and self.staging.exists():
            _publish(self.staging, self.target)
        return self.target


_ASYNC = {"world": None, "group": None}


def _async_group():
    """A gloo group of all ranks for the background writes' collectives (DCP plans and gathers its
    metadata in the writing thread; on the training group those would interleave with the step's
    collectives). Made at the first asynchronous save, which every rank reaches together."""
    world = dist.group.WORLD
    if _ASYNC["world"] is not world:  # none yet, or made in a process group since destroyed
        from datetime import timedelta

        from autopar.codegen.runtime import collective_timeout_s

        timeout = timedelta(seconds=collective_timeout_s())  # not gloo's 30 minutes: a lost peer fails the write
        _ASYNC["world"], _ASYNC["group"] = world, dist.new_group(backend="gloo", timeout=timeout)
    return _ASYNC["group"]


def load(module, path: str | Path, *, optimizer=None, prefix: str = "") -> dict:
    """Load a checkpoint into this rank's shards; returns the saved `extra` ({} if none)."""
    source = Path(path)
    if _is_safetensors(source):
        if optimizer is not None:
            raise CheckpointError(f"{source} is a safetensors checkpoint (model weights only): load the optimizer "
                                  "state from a checkpoint saved with pm.save, or leave optimizer= out")
        load_safetensors(module, source, prefix=prefix)
        return {}
    if not is_dcp_checkpoint(source):
        hint = " (a save that did not finish: use an earlier checkpoint)" if source.name.endswith(".partial") \
            or source.with_name(source.name + ".partial").exists() else ""
        raise CheckpointError(f"{source} is not a complete checkpoint: no {_METADATA} file in it{hint}; pass a "
                              "folder written by pm.save, or a .safetensors file / folder")
    metadata = dcp.FileSystemReader(str(source)).read_metadata()
    saved_keys = set(metadata.state_dict_metadata)
    state = {"model": _model_state(module, saved_keys, source)}
    if optimizer is not None:
        if not any(key.startswith("optimizer.") for key in saved_keys):
            raise CheckpointError(f"{source} holds no optimizer state (it was saved without optimizer=): "
                                  "load it without optimizer=")
        state["optimizer"] = optimizer_state(module, optimizer)
    if "extra" in saved_keys:
        raise CheckpointError(f"{source} was saved by an earlier autopar (its extra is a pickle, which autopar "
                              "no longer loads: it could run code); load it with that version, or save again")
    tensors = _extra_tensors(metadata)
    if checkpoint_extra.JSON_KEY in saved_keys:
        state[checkpoint_extra.JSON_KEY] = ""
        state[checkpoint_extra.TENSORS_KEY] = tensors
    dcp.load(state, checkpoint_id=str(source))
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, optim_state_dict=_renamed(state["optimizer"], module, back=True),
                                 options=_OPTIONS)
    if checkpoint_extra.JSON_KEY not in saved_keys:
        return {}
    try:
        return checkpoint_extra.decode(state[checkpoint_extra.JSON_KEY], tensors)
    except checkpoint_extra.ExtraError as error:
        raise CheckpointError(f"{source}: {error}") from None


def _extra_tensors(metadata) -> dict[str, torch.Tensor]:
    """Empty tensors of the saved extra's tensors' shapes and dtypes, for DCP to fill."""
    prefix = checkpoint_extra.TENSORS_KEY + "."
    return {key[len(prefix):]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}


def _model_state(module, saved_keys: set[str], source: Path) -> dict:
    state = module.state_dict()
    missing = sorted(key for key in state if f"model.{key}" not in saved_keys)
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{source} lacks {listed}: it was saved from another model (its names are the "
                              "original model's parameter names)")
    return state


def optimizer_state(module, optimizer) -> dict:
    """The optimizer's flattened state keyed by the original model's parameter names."""
    return _renamed(get_optimizer_state_dict(module, optimizer, options=_OPTIONS), module, back=False)


def _renamed(state: dict, module, *, back: bool) -> dict:
    """"state.<rank-local name>.exp_avg" <-> "state.<original name>.exp_avg"."""
    local_to_original = module.original_names()
    mapping = {value: key for key, value in local_to_original.items()} if back else local_to_original
    renamed = {}
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        renamed[f"{kind}.{mapping.get(name, name)}.{field}"] = value
    return renamed


# --- Hugging Face safetensors ----------------------------------------------------------------

def _is_safetensors(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and not is_dcp_checkpoint(path) and any(path.glob("*.safetensors"))


def load_safetensors(module, path: Path, *, prefix: str = "",
                     rename: Callable[[str], str] | None = None) -> None:
    """Load weights from safetensors files; file key K fills parameter `prefix + K` (or
    `rename(K)`); a tied weight is found under any of its names."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = path.parent if path.is_file() else path
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    if path.is_file() and len(list(folder.glob("*.safetensors"))) > 1:
        raise CheckpointError(f"{folder} holds several .safetensors files and DCP reads a whole folder: pass the "
                              "folder (all shards of one checkpoint), or move the file into its own folder")
    file_keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            file_keys.extend(handle.keys())
    ours_of_file_key = {key: (rename(key) if rename else prefix + key) for key in file_keys}
    by_ours = {ours: key for key, ours in ours_of_file_key.items()}
    state = {}
    missing = []
    for fqn, tensor in module.state_dict().items():
        names = [fqn, *module.parameter_aliases.get(fqn, [])]
        key = next((by_ours[name] for name in names if name in by_ours), None)
        if key is None:
            missing.append(fqn)
        else:
            state[key] = tensor
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path} has no tensor for {listed} (file keys look like '{file_keys[0] if file_keys else ''}'"
                              f"; mapped with prefix '{prefix}'): pass prefix= so that prefix + file key is the "
                              "model's parameter name")
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))


def num_bytes(state: dict) -> int:
    """Bytes of the tensors this rank holds in a state dict (local shards)."""
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Write a full tensor (or a DTensor of any layout) into `target`'s local shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(source, DTensor):
            source = source.full_tensor()
        if tuple(source.shape) != tuple(target.shape):
            raise CheckpointError(f"a tensor of shape {tuple(source.shape)} cannot fill a parameter of shape "
                                  f"{tuple(target.shape)}: the state dict is from another model configuration")
        if isinstance(target, DTensor):
            local = source.to(target.device, target.dtype)
            shard = distribute_tensor(local, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(source)

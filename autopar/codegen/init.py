"""Models built on `meta`: materialise only this rank's shards, then initialise them.

    pm = autopar.parallelize(model_on_meta, cluster, inputs, loss_fn=..., init_fn=None)

As in torchtitan, the model is built on meta (no memory), parallelised, and only then given
storage: each parameter gets an empty local shard of the plan's placement on this rank's device
(`to_empty` per shard), each buffer an empty full tensor. Then the shards are initialised in
place by running the model's own code on them: the original module's parameters and buffers are
swapped for this rank's tensors (DTensors under tensor parallelism, FSDP's sharded DTensors
under ZeRO, meta for the parameters of other pipeline stages) and one of these runs:
  - `init_fn(model)`, when given;
  - else `model.init_weights()` (torchtitan, Hugging Face and autopar's models have one);
  - else `reset_parameters()` of every submodule that has one (torch's own convention).
Ops on meta tensors do nothing, so each rank fills only what it holds.

Random draws are made deterministic per parameter: every random init op (`normal_`,
`uniform_`, `nn.init.*`) on a tensor this rank holds runs with the default generator reseeded from
the base seed, the parameter's name, how many random ops that parameter has seen, and the
coordinates of this rank's shard (and restored after). Replicas of the same shard (data-parallel copies, tensor-parallel replicated
parameters, tied copies on two pipeline stages) therefore draw identical values, and different
shards of one tensor draw different ones. A parameter that no plan shards gets the same values
under every plan and on one device (`seeded_init(model)` runs the same init in one process).
A sharded parameter gets values that depend on its shard layout (the CPU generator cannot jump
ahead to a shard's offset as CUDA's Philox can); where bitwise equality with a one-device init
matters, save that init once as a checkpoint and pass its path as `init_fn` (torchtitan's
"seed checkpoint").

Whatever the init leaves unwritten is still NaN afterwards (storage starts as NaN), and is
reported instead of training on garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from autopar.errors import ConfigError

_RANDOM_FUNCTIONS = frozenset({
    # Tensor methods
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
    # torch.nn.init (each draws through one of the methods above)
    "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_",
    "sparse_"})


def on_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


def empty_shard(param: torch.Tensor, placements: list, mesh, device: torch.device) -> torch.Tensor:
    """This rank's shard of a meta parameter as NaN-filled storage (a DTensor on `mesh` when
    given, a plain full-size tensor otherwise)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if mesh is None:
        return _nan_tensor(param.shape, param.dtype, device)
    local_shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    local = _nan_tensor(local_shape, param.dtype, device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape,
                              stride=_contiguous_stride(param.shape))


def empty_buffer(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _nan_tensor(buffer.shape, buffer.dtype, device)


def _nan_tensor(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    return tensor


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def initialise(model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *,
               init_fn: Callable | None, seed: int) -> None:
    """Run the model's init (or `init_fn`) on this rank's tensors, keyed RNG, then check it."""
    with swapped_tensors(model, params, buffers), SeededInit(params, buffers, seed=seed):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators")
            run_model_init(model, init_fn)
    check_initialised(params, buffers)


def run_model_init(model: nn.Module, init_fn: Callable | None) -> None:
    if init_fn is not None:
        init_fn(model)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights()
    else:
        found = False
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                found = True
        if not found:
            raise ConfigError(f"{type(model).__name__} is on meta but has no init_weights() and no submodule has "
                              "reset_parameters(): pass init_fn= (called with the model on this rank's shards) or "
                              "a checkpoint path as init_fn")


def seeded_init(model: nn.Module, seed: int, init_fn: Callable | None = None) -> None:
    """The same keyed-RNG init on an ordinary one-device model (the reference for meta init)."""
    params = {name: param for name, param in model.named_parameters()}
    buffers = {name: buffer for name, buffer in model.named_buffers()}
    with SeededInit(params, buffers, seed=seed), torch.no_grad():
        run_model_init(model, init_fn)


def check_initialised(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    untouched = [name for name, tensor in {**params, **buffers}.items()
                 if tensor.is_floating_point() and _local(tensor).numel() and bool(_local(tensor).isnan().any())]
    if untouched:
        listed = ", ".join(untouched[:5]) + (f" and {len(untouched) - 5} more" if len(untouched) > 5 else "")
        raise ConfigError(f"after initialising the meta model, {listed} still hold unset values (NaN): its init "
                          "(init_weights / reset_parameters / init_fn) does not cover them; pass an init_fn that "
                          "sets every parameter and buffer, or a checkpoint path as init_fn")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    # A wrapper subclass without storage of its own keeps its data in `_tensor` (torchao's
    # WeightWithDynamicFloat8CastTensor: float8 weights FSDP2 gathers in float8, codegen/fp8.py).
    inner = getattr(local, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else local


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> Iterator:
    """The model's parameters and buffers replaced by this rank's tensors, then put back."""
    saved = []
    names_of = all_names(model)
    for fqn, value in list(params.items()) + list(buffers.items()):
        for name in names_of.get(fqn, [fqn]):
            owner_name, _, attribute = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            table = owner._parameters if attribute in owner._parameters else owner._buffers
            saved.append((table, attribute, table[attribute]))
            table[attribute] = value
    try:
        yield
    finally:
        for table, attribute, original in reversed(saved):
            table[attribute] = original


def all_names(model: nn.Module) -> dict[str, list[str]]:
    """First name -> every name of that tensor (tied weights have several)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(first.setdefault(id(tensor), name), []).append(name)
    return names


class SeededInit(TorchFunctionMode):
    """Gives each in-place random op on a known tensor a generator keyed by (seed, tensor name,
    op count on that tensor, shard coordinates), so replicas agree and shards differ."""

    def __init__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.name_of_storage = {}
        for name, tensor in {**buffers, **params}.items():
            pointer = _storage_pointer(tensor)
            if pointer:
                self.name_of_storage[pointer] = (name, _shard_coordinates(tensor))
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor")  # nn.init functions pass it by keyword
        if getattr(func, "__name__", "") not in _RANDOM_FUNCTIONS or not isinstance(target, torch.Tensor) \
                or on_meta(target) or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        found = self.name_of_storage.get(_storage_pointer(target))
        name, coordinates = found if found else ("<unnamed>", ())
        count = self.counts.get(name, 0)
        self.counts[name] = count + 1
        # The default generator, reseeded for this op and restored after: DTensor's dispatch on
        # CPU draws each shard locally from it (it drops a `generator=` argument), and nn.init's
        # functions must see the DTensor (its full shape sets their fan-in) rather than a shard.
        generator = _default_generator(_local(target).device)
        state = generator.get_state()
        generator.manual_seed(_key(self.seed, name, count, coordinates))
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(state)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _storage_pointer(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    if on_meta(local) or local.numel() == 0:
        return 0
    return local.untyped_storage().data_ptr()


def _shard_coordinates(tensor: torch.Tensor) -> tuple[int, ...]:
    """(mesh dim, this rank's index) for each mesh dim that shards the tensor: () for a replica."""
    if not isinstance(tensor, DTensor):
        return ()
    coordinate = tensor.device_mesh.get_coordinate() or [0] * tensor.device_mesh.ndim
    return tuple(item for dim, (index, placement) in enumerate(zip(coordinate, tensor.placements))
                 if isinstance(placement, Shard) for item in (dim, index))


def _key(seed: int, name: str, count: int, coordinates: tuple[int, ...]) -> int:
    text = f"{seed}|{name}|{count}|{','.join(map(str, coordinates))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)

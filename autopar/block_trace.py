"""Which repeated blocks run identically: one eager forward on meta tensors, op by op.

Capturing a 96-layer model with torch.export traces every layer although layers 1..95 run the
same ops (design principle 4). `repeated_blocks` finds the `nn.ModuleList`/`nn.Sequential`
containers whose children are interchangeable, so that capture can trace two of them and copy
the second for the rest (block_reuse.py). Interchangeable means, for children 1..N-1:

- the same modules and parameter/buffer shapes, none shared with another module;
- the same aten ops with the same shapes and arguments, each tensor read from the same place
  relative to the child: its own earlier op, an op of the child k places before, its own
  parameter, or the same op or parameter outside the container;
- nothing runs between children (no parent-forward op between layers), and what runs after the
  container reads only the last child.

The check runs the model once on fake tensors under a TorchDispatchMode (no autograd, no tracing):
milliseconds per layer where torch.export takes a tenth of a second. A model that cannot run
eagerly on meta simply gets the full capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.blocks import block_prefixes

MIN_CHILDREN = 3
"""Fewer children gain nothing: capture traces two of them anyway."""


@dataclass(frozen=True, kw_only=True)
class RepeatedBlocks:
    """A container whose children 1..N-1 run the same ops, child k reading child k-1 as child 1 reads child 0."""

    container: str
    """Path of the ModuleList/Sequential in the model ("layers", "model.layers")."""
    child_names: tuple[str, ...]
    """Names of its children in order ("0", "1", ...)."""

    def path(self, index: int) -> str:
        """Module path of child `index`."""
        name = self.child_names[index]
        return f"{self.container}.{name}" if self.container else name

    @property
    def num_children(self) -> int:
        return len(self.child_names)


def repeated_blocks(model: nn.Module, inputs: tuple, kwargs: dict, log: Callable[[str], None] = lambda message: None,
                    *, strict: bool = False) -> tuple[RepeatedBlocks, ...]:
    """The containers of `model` whose children are interchangeable (see the module docstring).
    `strict` raises what the eager forward raises instead of returning ()."""
    candidates = [(path, children) for path, children in block_prefixes(model)
                  if path and len(children) >= MIN_CHILDREN and _same_modules(model, path, children)]
    if not candidates:
        return ()
    recorder = _Recorder(model, candidates)
    try:
        # Under a fake-tensor mode, as torch.export runs it: libraries (transformers) take their
        # tracing paths, without the data-dependent checks that fail on plain meta tensors.
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), recorder.hooks(), recorder:
            model(*inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure only means no reuse
        if strict:
            raise
        log(f"capture: blocks not reused (the model does not run eagerly on meta: {type(error).__name__})")
        return ()
    found = []
    for index, (path, children) in enumerate(candidates):
        reason = recorder.mismatch(index)
        if reason:
            log(f"capture: blocks of '{path}' not reused: {reason}")
            continue
        found.append(RepeatedBlocks(container=path, child_names=tuple(child.rsplit(".", 1)[-1] for child in children)))
    return tuple(found)


def _same_modules(model: nn.Module, path: str, children: list[str]) -> bool:
    """Same module types and parameter/buffer shapes in every child; no tensor shared with another module."""
    owners: dict[int, int] = {}
    for _, tensor in _all_tensors(model):
        owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    keys = []
    for child_path in children:
        child = model.get_submodule(child_path)
        tensors = _all_tensors(child)
        if any(owners.get(id(tensor), 0) != 1 for _, tensor in tensors):
            return False
        keys.append((tuple((name, type(module)) for name, module in child.named_modules()),
                     tuple((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad) for name, tensor in tensors)))
    return all(key == keys[0] for key in keys[1:])


def _all_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


class _Recorder(TorchDispatchMode):
    """Records every aten op of one forward: which child ran it and where its tensors came from."""

    def __init__(self, model: nn.Module, candidates: list[tuple[str, list[str]]]) -> None:
        super().__init__()
        self.model = model
        self.candidates = candidates
        self.child_of: dict[int, tuple[int, int]] = {}  # id(child module) -> (container, child)
        self.tensor_owner: dict[int, tuple[tuple[int, int] | None, str]] = {}  # id(param) -> (child, name)
        for container, (_, children) in enumerate(candidates):
            for index, child_path in enumerate(children):
                child = model.get_submodule(child_path)
                self.child_of[id(child)] = (container, index)
                for name, tensor in _all_tensors(child):
                    self.tensor_owner[id(tensor)] = ((container, index), name)
        for name, tensor in _all_tensors(model):
            self.tensor_owner.setdefault(id(tensor), (None, name))
        self.current: tuple[int, int] | None = None
        self.calls: dict[tuple[int, int], int] = {}
        self.nested = False
        self.ops: list[tuple] = []
        """Per op: (owner child or None, position within the child, description)."""
        self.op_count: dict[tuple[int, int], int] = {}
        self.producer: dict[int, tuple[int, int]] = {}  # id(tensor) -> (op index, output position)
        self.alive: list = []  # outputs stay referenced so that no id is reused during the forward
        self.outside: dict[int, int] = {}  # id(tensor) of inputs and other tensors -> first-seen order

    # --- module hooks ---------------------------------------------------------------------

    def hooks(self):
        recorder = self

        class _Hooks:
            def __enter__(self):
                self.handles = []
                for path, children in recorder.candidates:
                    for child_path in children:
                        child = recorder.model.get_submodule(child_path)
                        self.handles.append(child.register_forward_pre_hook(recorder._enter))
                        self.handles.append(child.register_forward_hook(recorder._leave))
                return self

            def __exit__(self, *exc):
                for handle in self.handles:
                    handle.remove()
                return False

        return _Hooks()

    def _enter(self, module, args):
        key = self.child_of[id(module)]
        if self.current is not None:
            self.nested = True
        self.calls[key] = self.calls.get(key, 0) + 1
        self.current = key

    def _leave(self, module, args, output):
        self.current = None

    # --- ops --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        owner = self.current
        flat_args, _ = tree_flatten((args, kwargs))
        described = tuple(self._describe(value, owner) for value in flat_args)
        flat_out, _ = tree_flatten(result)
        outputs = tuple((tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else repr(value)
                        for value in flat_out)
        position = self.op_count.get(owner, 0) if owner is not None else len(self.ops)
        if owner is not None:
            self.op_count[owner] = position + 1
        index = len(self.ops)
        self.ops.append((owner, position, (str(func), described, outputs)))
        for output_index, value in enumerate(flat_out):
            if isinstance(value, torch.Tensor):
                self.producer[id(value)] = (index, output_index)
                self.alive.append(value)
        return result

    def _describe(self, value, owner: tuple[int, int] | None):
        if not isinstance(value, torch.Tensor):
            return ("value", repr(value))
        meta = (tuple(value.shape), value.dtype)
        if id(value) in self.producer:
            op_index, output_index = self.producer[id(value)]
            source = self.ops[op_index][0]
            return ("op", *self._relative(source, owner, self.ops[op_index][1]), output_index, meta)
        if id(value) in self.tensor_owner:
            child, name = self.tensor_owner[id(value)]
            return ("tensor", *self._relative(child, owner, name), meta)
        return ("outside", self.outside.setdefault(id(value), len(self.outside)), meta)

    @staticmethod
    def _relative(source: tuple[int, int] | None, owner: tuple[int, int] | None, where) -> tuple:
        """Where a source lies as seen from the op's child: ("self", where), ("back", k, where)
        for the child k places before in the same container, or absolutely."""
        if source is not None and owner is not None and source[0] == owner[0]:
            return ("self", where) if source[1] == owner[1] else ("back", owner[1] - source[1], where)
        return ("at", source, where)

    # --- verdict -----------------------------------------------------------------------------

    def mismatch(self, container: int) -> str:
        """Why the children of `container` are not interchangeable ("" when they are)."""
        _, children = self.candidates[container]
        count = len(children)
        if self.nested:
            return "a block runs inside another"
        if any(self.calls.get((container, index), 0) != 1 for index in range(count)):
            return "a block runs more or less than once per forward"
        per_child: list[list[tuple]] = [[] for _ in range(count)]
        order: list[int] = []  # op indices of this container, in execution order
        for index, (owner, _, description) in enumerate(self.ops):
            if owner is not None and owner[0] == container:
                per_child[owner[1]].append(description)
                order.append(index)
        if not per_child[1]:
            return "a block runs no ops"
        if any(child != per_child[1] for child in per_child[2:]):
            return "the blocks run different ops"
        owners = [self.ops[index][0][1] for index in order]
        if owners != sorted(owners) or order[-1] - order[0] + 1 != len(order):
            return "ops run between the blocks"
        last = order[-1]
        for owner, _, (_, described, _) in self.ops[last + 1:]:
            for item in described:
                source = item[2] if item[0] in ("op", "tensor") and item[1] == "at" else None
                if source is not None and source[0] == container and (item[0] == "tensor" or source[1] != count - 1):
                    return "what follows the blocks reads a block other than the last"
        return ""

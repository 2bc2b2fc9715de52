"""Which repeated blocks are interchangeable modules (block_reuse.py traces three of them).

A container (`nn.ModuleList`/`nn.Sequential`, blocks.py) qualifies when every child has the
same modules (types and relative names), the same parameter and buffer shapes, dtypes and
`requires_grad`, no tensor shared with another module, and the same plain attributes except
an index (`layer_idx` = the child's position plus a constant, as Hugging Face and Megatron
number layers). A choice a layer makes at construction (Gemma-2's sliding window on every
other layer, a mixture-of-experts MLP on some) is an attribute or a module that differs, so
such layers are not interchangeable. What the forward does with them is checked on the
traced blocks themselves: the third must be the second shifted by one (block_reuse.py).

Not caught: a forward that branches on its index with a period of three or more without
storing the choice (`if self.layer_idx % 4 == 3:` inside forward). `reuse_blocks=False`
(capture_for_planning) captures every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.blocks import block_prefixes

CAPTURED_CHILDREN = 3
"""Children traced per container: the first (it reads the prologue), and two that show how a
block reads the one before it."""


@dataclass(frozen=True, kw_only=True)
class RepeatedBlocks:
    """A container whose children are interchangeable modules."""

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


def repeated_blocks(model: nn.Module) -> tuple[RepeatedBlocks, ...]:
    """The containers of `model` with more children than are traced, all interchangeable."""
    counts: dict[int, int] = {}
    for _, tensor in _all_tensors(model):
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    found = []
    for path, children in block_prefixes(model):
        if path and len(children) > CAPTURED_CHILDREN and _interchangeable(model, children, counts):
            found.append(RepeatedBlocks(container=path,
                                        child_names=tuple(child.rsplit(".", 1)[-1] for child in children)))
    return tuple(found)


def _all_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def _interchangeable(model: nn.Module, children: list[str], counts: dict[int, int]) -> bool:
    modules = [model.get_submodule(path) for path in children]
    keys = []
    for child in modules:
        tensors = _all_tensors(child)
        if any(counts.get(id(tensor), 0) != 1 for _, tensor in tensors):
            return False  # shared with another block or module (tied): copies would not be
        keys.append((tuple((name, type(module)) for name, module in child.named_modules()),
                     tuple((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad) for name, tensor in tensors)))
    if any(key != keys[0] for key in keys[1:]):
        return False
    per_child = [[_attributes(module) for _, module in child.named_modules()] for child in modules]
    for position in range(len(per_child[0])):
        values = [attributes[position] for attributes in per_child]
        names = set(values[0])
        if any(set(value) != names for value in values[1:]):
            return False
        for name in names:
            column = [value[name] for value in values]
            if not (all(_same(column[0], item) for item in column[1:]) or _is_index(column)):
                return False
    return True


def _attributes(module: nn.Module) -> dict[str, object]:
    """Plain attributes a forward may branch on (torch's own bookkeeping left out)."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and name != "training"}


def _same(first, second) -> bool:
    if first is second:
        return True
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
                and first.shape == second.shape and first.dtype == second.dtype)
    try:
        return type(first) is type(second) and bool(first == second)
    except Exception:  # noqa: BLE001 - values that do not compare are taken as different
        return False


def _is_index(column: list) -> bool:
    """Integers that count the children (layer_idx = position + constant)."""
    if not all(type(value) is int for value in column):
        return False
    return len({value - position for position, value in enumerate(column)}) == 1

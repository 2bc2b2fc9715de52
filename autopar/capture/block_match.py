"""Which repeated blocks are interchangeable modules (block_reuse.py traces a few of them).

A container (`nn.ModuleList`/`nn.Sequential`, blocks.py) qualifies when its children, from some
child `first` on, repeat with a `period`: child i and child i + period have the same modules
(types and relative names), the same parameter and buffer shapes, dtypes and `requires_grad`,
no tensor shared with another module, and the same plain attributes except an index
(`layer_idx` = the child's position plus a constant, as Hugging Face and Megatron number
layers). Most stacks repeat from child 0 with period 1. T5's first block alone holds the
relative position bias (first = 1); Gemma-2 alternates sliding-window and global attention
layers, an attribute set at construction (period 2). The children before `first` and three
periods are traced; what the forward does with them is checked on the traced children
themselves: the last period must be the one before it shifted by one period (block_reuse.py).

Not caught: a forward that branches on its index with a period longer than the one found
without storing the choice (`if self.layer_idx % 4 == 3:` inside forward). `reuse_blocks=False`
(capture_for_planning) captures every layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from autopar.capture.blocks import block_prefixes

CAPTURED_PERIODS = 3
"""Periods traced per container: the first (it reads the prologue, or the children before
`first`), and two that show how a period reads the one before it."""
MAX_FIRST = 3
"""At most this many leading children may differ from the repeating rest (DeepSeek-V3: three dense layers)."""
MAX_PERIOD = 8
"""Longest repeat looked for (Gemma-2: 2; Gemma-3's five local layers and one global: 6)."""


@dataclass(frozen=True, kw_only=True)
class RepeatedBlocks:
    """A container whose children are interchangeable modules."""

    container: str
    """Path of the ModuleList/Sequential in the model ("layers", "model.layers")."""
    child_names: tuple[str, ...]
    """Names of its children in order ("0", "1", ...)."""
    first: int = 0
    """Index of the first repeating child; those before it are traced as they are."""
    period: int = 1
    """Child i (i >= first) is interchangeable with child i + period."""

    def path(self, index: int) -> str:
        """Module path of child `index`."""
        name = self.child_names[index]
        return f"{self.container}.{name}" if self.container else name

    @property
    def num_children(self) -> int:
        return len(self.child_names)

    @property
    def num_captured(self) -> int:
        """Children traced: the leading ones and three periods."""
        return self.first + CAPTURED_PERIODS * self.period

    def template(self, index: int) -> int:
        """The traced child (in the last traced period) that child `index` copies."""
        return self.first + (CAPTURED_PERIODS - 1) * self.period + (index - self.first) % self.period


def repeated_blocks(model: nn.Module) -> tuple[RepeatedBlocks, ...]:
    """The containers of `model` whose children repeat, with more children than are traced."""
    counts: dict[int, int] = {}
    for _, tensor in _all_tensors(model):
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    found = []
    for path, children in block_prefixes(model):
        layout = _layout(model, children, counts) if path else None
        if layout is not None:
            found.append(RepeatedBlocks(container=path, child_names=tuple(child.rsplit(".", 1)[-1] for child in children),
                                        first=layout[0], period=layout[1]))
    return tuple(found)


def _all_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def _layout(model: nn.Module, children: list[str], counts: dict[int, int]) -> tuple[int, int] | None:
    """(first, period) that traces the fewest children, or None when no repeat saves tracing."""
    modules = [model.get_submodule(path) for path in children]
    num_children = len(modules)
    shared, keys = [], []
    for child in modules:
        tensors = _all_tensors(child)
        # A tensor shared with another block or module (tied): copies would not be.
        shared.append(any(counts.get(id(tensor), 0) != 1 for _, tensor in tensors))
        keys.append((tuple((name, type(module)) for name, module in child.named_modules()),
                     tuple((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad) for name, tensor in tensors)))
    attributes = [[_attributes(module) for _, module in child.named_modules()] for child in modules]
    layouts = sorted((first + CAPTURED_PERIODS * period, first, period)
                     for first in range(MAX_FIRST + 1) for period in range(1, MAX_PERIOD + 1))
    for captured, first, period in layouts:
        if captured >= num_children or (num_children - first) % period or any(shared[first:]):
            continue
        if any(keys[index] != keys[index + period] for index in range(first, num_children - period)):
            continue
        if all(_alike_attributes([attributes[index] for index in positions], positions)
               for positions in (range(first + phase, num_children, period) for phase in range(period))):
            return first, period
    return None


def _alike_attributes(per_child: list[list[dict[str, object]]], positions: range) -> bool:
    """Children (at `positions`) whose modules' attributes are equal, or count the children."""
    for position in range(len(per_child[0])):
        values = [attributes[position] for attributes in per_child]
        names = set(values[0])
        if any(set(value) != names for value in values[1:]):
            return False
        for name in names:
            column = [value[name] for value in values]
            if not (all(_same(column[0], item) for item in column[1:]) or _is_index(column, positions)):
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
    if isinstance(first, functools.partial) and isinstance(second, functools.partial):
        # transformers' ACT2FN makes a new partial (gelu with approximate="tanh") per module.
        return (first.func is second.func and len(first.args) == len(second.args)
                and all(_same(a, b) for a, b in zip(first.args, second.args))
                and first.keywords.keys() == second.keywords.keys()
                and all(_same(first.keywords[key], second.keywords[key]) for key in first.keywords))
    try:
        return type(first) is type(second) and bool(first == second)
    except Exception:  # noqa: BLE001 - values that do not compare are taken as different
        return False


def _is_index(column: list, positions: range) -> bool:
    """Integers that count the children (layer_idx = position + constant)."""
    if not all(type(value) is int for value in column):
        return False
    return len({value - position for position, value in zip(positions, column)}) == 1

"""Repeated blocks and pipeline segments of a captured graph.

A block is one child of an `nn.ModuleList`/`nn.Sequential` (a transformer layer). Children
whose ops, shapes and parameter shapes are identical form one `BlockGroup`, which the solver
plans once. Segments are the contiguous runs of ops between which a pipeline stage may be cut.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from torch import nn

from autopar.graph import BlockGroup, OpNode, Ref, Segment


def block_prefixes(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(container path, child paths) for every ModuleList/Sequential with >= 2 children,
    outermost containers only (an expert list inside a layer is part of the layer)."""
    found: list[tuple[str, list[str]]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(path == outer or path.startswith(outer + ".") if outer else True for outer, _ in found):
            continue
        children = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
        found.append((path, children))
    return found


def _owner(module_path: str, prefixes: dict[str, str]) -> str | None:
    """The block instance a module path lies in (the longest matching prefix)."""
    parts = module_path.split(".")
    for length in range(len(parts), 0, -1):
        candidate = ".".join(parts[:length])
        if candidate in prefixes:
            return candidate
    return None


def find_blocks_and_segments(model: nn.Module, nodes: list[OpNode]) -> tuple[tuple[BlockGroup, ...], tuple[Segment, ...]]:
    containers = block_prefixes(model)
    instance_container = {child: container for container, children in containers for child in children}
    calls = [node for node in nodes if node.kind == "call"]
    owners = [_owner(node.module_path, instance_container) if node.module_path else None for node in calls]
    owners = _close_gaps(owners)
    members: dict[str, list[str]] = defaultdict(list)
    for node, owner in zip(calls, owners):
        if owner is not None:
            members[owner].append(node.name)
    by_name = {node.name: node for node in nodes}
    groups: list[BlockGroup] = []
    group_of_instance: dict[str, int] = {}
    for container, children in containers:
        by_signature: dict[str, list[str]] = defaultdict(list)
        for child in children:
            if members.get(child):
                by_signature[_signature(child, members[child], by_name)].append(child)
        for signature, instances in sorted(by_signature.items(), key=lambda item: children.index(item[1][0])):
            for instance in instances:
                group_of_instance[instance] = len(groups)
            groups.append(BlockGroup(container=container, instances=tuple(instances),
                                     nodes=tuple(tuple(members[i]) for i in instances), signature=signature))
    return tuple(groups), _segments(calls, owners, group_of_instance)


def _close_gaps(owners: list[str | None]) -> list[str | None]:
    """Ops that run inside a block's span (e.g. helpers called from its forward) join it."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for position, owner in enumerate(owners):
        if owner is not None:
            first.setdefault(owner, position)
            last[owner] = position
    closed = list(owners)
    for owner, start in first.items():
        for position in range(start, last[owner] + 1):
            if closed[position] is None:
                closed[position] = owner
    return closed


def _segments(calls: list[OpNode], owners: list[str | None], group_of_instance: dict[str, int]) -> tuple[Segment, ...]:
    runs: list[tuple[str | None, list[str]]] = []
    for node, owner in zip(calls, owners):
        if runs and runs[-1][0] == owner:
            runs[-1][1].append(node.name)
        else:
            runs.append((owner, [node.name]))
    segments = []
    seen_block = False
    for index, (owner, names) in enumerate(runs):
        if owner is not None:
            seen_block = True
            segments.append(Segment(name=owner, nodes=tuple(names), block_group=group_of_instance.get(owner)))
            continue
        later_block = any(run_owner is not None for run_owner, _ in runs[index + 1:])
        name = "prologue" if not seen_block else ("epilogue" if not later_block else f"between:{index}")
        segments.append(Segment(name=name, nodes=tuple(names)))
    return tuple(segments)


def _signature(prefix: str, names: list[str], by_name: dict[str, OpNode]) -> str:
    """Hash of an instance's ops with references made relative to the instance."""
    local = {name: position for position, name in enumerate(names)}
    external: dict[str, int] = {}
    items = []
    for name in names:
        node = by_name[name]
        refs = []
        for source in node.inputs:
            producer = by_name[source]
            if source in local:
                refs.append(("local", local[source]))
            elif producer.kind in ("param", "buffer"):
                relative = producer.target[len(prefix) + 1:] if producer.target.startswith(prefix + ".") else producer.target
                refs.append(("param", relative, producer.output.shape, producer.output.dtype))
            else:
                refs.append(("external", external.setdefault(source, len(external)), producer.output.shape))
        outputs = [(meta.shape, meta.dtype, meta.batch_coef) for meta in node.outputs]
        items.append((node.target, _strip_refs(node.args), node.kwargs, tuple(refs), tuple(outputs),
                      node.module_path[len(prefix):]))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _strip_refs(args):
    if isinstance(args, Ref):
        return ("ref", args.index)
    if isinstance(args, (list, tuple)):
        return tuple(_strip_refs(item) for item in args)
    return args

"""One order and one set of node names for an exported graph, whatever the process.

Model code that loops over a set of strings (52 Hugging Face models compute their rotary
embeddings with `for layer_type in set(config.layer_types)`) traces its ops in an order that
follows Python's string hashes, which differ from process to process (torchrun does not fix
PYTHONHASHSEED). Rank 0's plan and another rank's capture then differ in node order and in the
names export numbers ops by ("to_9" is one layer type's op in one process, the other's in the
next): the fingerprints differ and a plan's per-node entries would point at other ops.

`canonicalize` sorts each run of side-effect-free ops of one module (outside the blocks, the
numbered children of a container, whose ops block reuse needs in export's order) between two
ops that keep their place (in-place writes, random ops, higher-order ops, inputs, outputs) by a
hash of what each op computes (its op, constant arguments and its inputs' hashes; parameters by
name, user inputs by position, values made before the run by their op, module and inputs), then
of where its value goes in the run, and renumbers the names of each op kind in that order.
Dtypes, devices and layout-only copies are left out of the hashes, and so is the loss wrapper:
rank 0's weightless bf16 replica with its loss and each rank's model are ordered alike.
"""

from __future__ import annotations

import hashlib
import heapq
import operator
import re

import torch

_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")
_NUMBERED_CHILD = re.compile(r"(^|\.)\d+(\.|$)")
_LAYOUT_ONLY = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
                torch.ops.aten.detach.default, torch.ops.aten.lift_fresh_copy.default)
"""Copies that come and go with the device a model is traced on: hashed as their input (and
dtypes and devices are left out), so that a meta bf16 replica and the model are ordered alike."""


def canonicalize(program, prefix: str = "") -> None:
    """Reorder and rename `program`'s (an ExportedProgram) call nodes in place. `prefix`: the
    loss wrapper's, left out of parameter names so that a capture with the loss orders the
    model's ops as one without it."""
    graph = program.graph
    names = _input_names(program, prefix)
    renamed: dict[str, str] = {}
    for run in _runs(list(graph.nodes)):
        ordered = _sorted_run(run, _digests(run, names, prefix))
        if ordered == run:
            continue
        anchor = run[0].prev
        for node in ordered:
            anchor.append(node)
            anchor = node
        renamed.update(_renumber(run, ordered))
    if not renamed:
        return
    arguments = [spec.arg for spec in program.graph_signature.output_specs]
    arguments += [argument for entry in program.module_call_graph if entry.signature is not None
                  for argument in entry.signature.outputs]
    for argument in arguments:
        if getattr(argument, "name", None) in renamed:
            argument.name = renamed[argument.name]
    graph.lint()
    program.graph_module.recompile()


def _input_names(program, prefix: str) -> dict[str, str]:
    """Placeholder -> what it is: a parameter's or buffer's name with its numbers left out (the
    same in every block), or the k-th user input (whose placeholder names differ with and
    without the loss wrapper)."""
    names, inputs = {}, 0
    for spec in program.graph_signature.input_specs:
        if spec.target is not None:
            names[spec.arg.name] = re.sub(r"\d+", "#", spec.target.removeprefix(prefix))
        else:
            names[spec.arg.name], inputs = f"input {inputs}", inputs + 1
    return names


def _digests(run: list, input_names: dict[str, str], prefix: str) -> dict:
    """Per node of `run`, (a hash of what it computes, a hash of where its value goes in the
    run). Both are local, so that every block orders its ops alike: a value made before the run
    counts as the parameter or input it is, else by its op, module and inputs (`_outside`)."""
    inside = set(run)
    upstream: dict = {}

    def label(value):
        if not isinstance(value, torch.fx.Node):
            return "" if isinstance(value, (torch.dtype, torch.device)) else value
        if value in upstream:
            return upstream[value]
        return _outside(value, input_names, prefix)

    for node in run:
        if node.target in _LAYOUT_ONLY and node.all_input_nodes:  # on some devices only (graph.py)
            upstream[node] = label(node.all_input_nodes[0])
            continue
        if _is_size(node):
            upstream[node] = _size_label(node)
            continue
        args = torch.fx.node.map_aggregate((node.args, node.kwargs), label)
        upstream[node] = _hash(repr((_target_name(node.target), args)))
    downstream: dict = {}
    for node in reversed(run):
        # used after the run: once however often (by every block, whatever their number)
        users = sorted({downstream[user] + str(user.all_input_nodes.index(source)) if user in inside else "out"
                        for source, user in _consumers(node)})
        downstream[node] = _hash(repr((upstream[node], users)))
    return {node: (upstream[node], downstream[node]) for node in run}


def _outside(node, input_names: dict[str, str], prefix: str, depth: int = 3) -> str:
    """A value made before the run: an input by what it is, else by its op, module and inputs
    (`depth` ops back), with block numbers left out, so that each block's run sees its own
    block's values and the values shared by all blocks (rotary tables, masks) alike."""
    if node.op == "placeholder":
        return input_names.get(node.name, node.name)
    if node.op == "get_attr":
        return re.sub(r"\d+", "#", str(node.target))
    if node.target in _LAYOUT_ONLY and node.all_input_nodes:
        return _outside(node.all_input_nodes[0], input_names, prefix, depth)
    if _is_size(node):
        return _size_label(node)
    sources = [_outside(source, input_names, prefix, depth - 1) for source in node.all_input_nodes] if depth else []
    module = _module(node)
    if prefix:  # the loss wrapper's module paths start with its attribute's name
        module = module.removeprefix(prefix.rstrip(".")).removeprefix(".")
    return _hash(repr((_target_name(node.target), re.sub(r"\d+", "#", module), sources)))


def _is_size(node) -> bool:
    """A symbolic size (the batch): export reads it from whichever input has it first, which the
    loss wrapper changes."""
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    return node.op == "call_function" and isinstance(node.meta.get("val"), symbolic)


def _size_label(node) -> str:
    constants = [arg for arg in node.args if not isinstance(arg, torch.fx.Node)]
    return _hash(repr(("size", _target_name(node.target), constants)))


def _consumers(node):
    """(input, user) for each user of `node`, looking through layout-only copies."""
    for user in node.users:
        if user.target in _LAYOUT_ONLY:
            yield from _consumers(user)
        else:
            yield node, user


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}"


def _fixed(node) -> bool:
    """Whether `node` keeps its place: anything but a pure call (an in-place or random op, a
    higher-order op, a Python callable other than getitem)."""
    if node.op != "call_function":
        return node.op != "get_attr"
    target = node.target
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags


def _runs(nodes: list) -> list[list]:
    """Maximal runs of movable nodes of one module outside the numbered children of a container
    (the blocks). Ops never move across a module boundary (blocks, pipeline segments and block
    reuse read the graph in module order), nor inside a block, whose ops block reuse needs in
    export's order in every block (where hashes would order blocks' ops unlike each other)."""
    runs, current = [], []
    for node in nodes:
        movable = not _fixed(node) and not _NUMBERED_CHILD.search(_module(node))
        if current and (not movable or _module(node) != _module(current[-1])):
            if len(current) > 1:
                runs.append(current)
            current = []
        if movable:
            current.append(node)
    if len(current) > 1:
        runs.append(current)
    return runs


def _module(node) -> str:
    """The innermost module whose forward made `node` (its path as export records it)."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _sorted_run(run: list, digests: dict) -> list:
    """The run in topological order, the smallest hashes first among the ready nodes (equal
    hashes: the same computation for the same consumers, in the order they came)."""
    inside = set(run)
    waiting = {node: sum(1 for source in node.all_input_nodes if source in inside) for node in run}
    ready = [(digests[node], index, node) for index, node in enumerate(run) if waiting[node] == 0]
    heapq.heapify(ready)
    position = {node: index for index, node in enumerate(run)}
    ordered = []
    while ready:
        _, _, node = heapq.heappop(ready)
        ordered.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= sum(1 for source in user.all_input_nodes if source is node)
                if waiting[user] == 0:
                    heapq.heappush(ready, (digests[user], position[user], user))
    return ordered


def _renumber(run: list, ordered: list) -> dict[str, str]:
    """Gives each op kind's names, in their numbered order, to its nodes in the new order."""
    names: dict[str, list[str]] = {}
    for node in run:
        names.setdefault(_base(node.name), []).append(node.name)
    for group in names.values():
        group.sort(key=lambda name: int(_NUMBERED.match(name).group(2) or 0))
    renamed = {}
    for node in ordered:
        new = names[_base(node.name)].pop(0)
        if new != node.name:
            renamed[node.name] = new
    by_old = {node.name: node for node in run}
    for old, new in renamed.items():
        node = by_old[old]
        node.name = new
        node.graph._graph_namespace._rename_object(node, new)
    return renamed


def _base(name: str) -> str:
    return _NUMBERED.match(name).group(1)

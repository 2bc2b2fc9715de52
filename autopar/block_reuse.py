"""Capture N identical blocks by tracing three (design principle 4).

torch.export's time grows with the model's depth: GPT-3 175B's 96 layers are 4,500 nodes to
trace although layers 1..95 are one layer 95 times. When block_match.py finds a container of
interchangeable children, the model is exported with its first three children only. Block 0
reads the prologue; block 2 must be block 1 shifted by one (the same ops, shapes, costs and
arguments, each input read from the block before it where block 1 reads block 0, or from the
same place outside), which is the recurrence the copies follow: block 2's nodes and parameters
are copied for children 3..N-1, each copy reading the copy before it, and what followed block 2
(the final norm, the head, the loss) reads the last copy.

The result is the graph the full capture gives, node for node: module paths, parameter names
and export's node names (`linear_17`: a counter per op kind in graph order, carried on by each
copy) included, so plans, fingerprints and codegen's name matching are unchanged. Anything that
does not fit that picture (blocks that differ, ops between blocks, a head that reads an earlier
block, lifted constants inside a block, names export did not number consecutively) returns None
and the caller captures in full.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from autopar.block_match import CAPTURED_CHILDREN, RepeatedBlocks, repeated_blocks
from autopar.blocks import find_blocks_and_segments
from autopar.errors import CaptureError
from autopar.graph import OpGraph, OpNode, ParamInfo

_COUNTER = re.compile(r"^(.*)_(\d+)$")


class _CannotExpand(Exception):
    """The reduced capture does not extend to all blocks; the caller captures in full."""


def capture_reusing_blocks(model: nn.Module, inputs: tuple, kwargs: dict, *, loss_fn=None, example_targets=None,
                           name: str = "", verbose: bool = False, strict: bool = False) -> OpGraph | None:
    """The OpGraph of `model` (as `capture` makes it) from a capture of three blocks per group
    of interchangeable ones; None when no container qualifies or the shortcut does not apply.

    `model` and the inputs are the meta replica planning captures (they are traced as given).
    Unexpected errors of the shortcut itself also return None (the full capture then runs)
    unless `strict`."""
    from autopar.capture import LOSS_WRAPPER_PREFIX, capture_program, targets_like_output

    log = _logger(verbose)
    started = time.perf_counter()
    repeated = repeated_blocks(model)
    if not repeated:
        return None
    log(f"capture: {', '.join(f'{r.num_children} blocks of {r.container!r}' for r in repeated)} are alike; "
        f"tracing {CAPTURED_CHILDREN} of each")
    try:
        with _truncated(model, repeated):
            targets = example_targets
            if loss_fn is not None and targets is None:
                targets = targets_like_output(model, inputs, kwargs)
            program, reduced = capture_program(model, inputs, kwargs, loss_fn=loss_fn, example_targets=targets,
                                               name=name, verbose=verbose, allow_fallback=False)
    except Exception as error:  # noqa: BLE001 - the full capture reports what is wrong, if anything
        if strict and not isinstance(error, CaptureError):
            raise
        log(f"capture: the shortened capture failed ({(str(error).splitlines() or [''])[0]}); capturing in full")
        return None
    try:
        graph = expand_blocks(reduced, _entries(program, reduced, LOSS_WRAPPER_PREFIX if loss_fn else ""),
                              model, repeated)
    except _CannotExpand as reason:
        log(f"capture: blocks not reused ({reason}); capturing in full")
        return None
    except Exception as error:  # noqa: BLE001 - the full capture is always a correct answer
        if strict:
            raise
        log(f"capture: blocks not reused ({type(error).__name__}: {error}); capturing in full")
        return None
    log(f"capture: {len(graph.nodes):,} nodes from {len(reduced.nodes):,} in {time.perf_counter() - started:.1f}s")
    return graph


def _logger(verbose: bool) -> Callable[[str], None]:
    import sys

    return (lambda message: print(message, file=sys.stderr, flush=True)) if verbose else (lambda message: None)


@contextlib.contextmanager
def _truncated(model: nn.Module, repeated: tuple[RepeatedBlocks, ...]):
    """`model` with only the first children of each container (restored on exit)."""
    swapped = []
    try:
        for blocks in repeated:
            parent_path, _, attribute = blocks.container.rpartition(".")
            parent = model.get_submodule(parent_path)
            original = parent._modules[attribute]
            short = copy.copy(original)  # same class (ModuleList, Sequential or a subclass)
            short._modules = dict(list(original._modules.items())[:CAPTURED_CHILDREN])
            parent._modules[attribute] = short
            swapped.append((parent, attribute, original))
        yield
    finally:
        for parent, attribute, original in reversed(swapped):
            parent._modules[attribute] = original


@dataclass
class _Entry:
    """One node of the exported program (OpNode or not: symbolic-size nodes take names too)."""

    name: str
    """Unique working name (copies get a temporary one until renumbering)."""
    placeholder: bool
    base: str
    """The name without export's `_N` counter."""
    counter: int
    """That counter (0: none)."""
    module_path: str
    node: OpNode | None


def _entries(program, graph: OpGraph, prefix: str) -> list[_Entry]:
    from autopar.capture import fx_module_path

    entries = []
    for fx_node in program.graph.nodes:
        placeholder = fx_node.op == "placeholder"
        base, counter = _split_counter(fx_node.name)
        entries.append(_Entry(name=fx_node.name, placeholder=placeholder, base=base, counter=counter,
                              module_path="" if placeholder else fx_module_path(fx_node, prefix),
                              node=graph.by_name.get(fx_node.name)))
    return entries


def expand_blocks(reduced: OpGraph, entries: list[_Entry], model: nn.Module,
                  repeated: tuple[RepeatedBlocks, ...]) -> OpGraph:
    """The full model's graph from the shortened capture `reduced` (its program's `entries`)."""
    if any(not entry.placeholder and _spelled(entry) != entry.name for entry in entries):
        raise _CannotExpand("a node name does not end in its counter")
    infos = {info.node: info for info in reduced.params}
    for blocks in repeated:
        entries = _expand_one(entries, blocks, infos)
    final = {entry.name: entry.name if entry.placeholder else _spelled(entry) for entry in entries}
    if len(set(final.values())) != len(final):
        raise _CannotExpand("the copies' node names collide")
    nodes, params = [], []
    for entry in entries:
        node = entry.node
        if node is None:
            continue
        name, inputs = final[node.name], tuple(final[source] for source in node.inputs)
        if name != node.name or inputs != node.inputs:
            node = replace(node, name=name, inputs=inputs)
        nodes.append(node)
        if node.kind in ("param", "buffer"):
            params.append(replace(infos[entry.name], node=name))
    blocks, segments = find_blocks_and_segments(model, nodes)
    return replace(reduced, nodes=tuple(nodes), params=tuple(params), blocks=blocks, segments=segments)


def _split_counter(name: str) -> tuple[str, int]:
    """`linear_17` -> ("linear", 17); `linear` -> ("linear", 0)."""
    match = _COUNTER.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _spelled(entry: _Entry) -> str:
    return f"{entry.base}_{entry.counter}" if entry.counter else entry.base


def _counter_steps(entries: list[_Entry], previous: list[int], template: list[int]) -> dict[str, int]:
    """Per op kind, how far one more block advances export's name counter: the block's nodes of
    that kind. torch.fx counts per kind in graph order; the last traced block's numbers must run
    without a gap, on from the block before it and up to what follows (export leaves gaps where
    it removed nodes: the first block of a Hugging Face Llama loses three symbolic-size `mul`s
    that later blocks reuse, which is why the steps come from the last blocks)."""
    by_kind: dict[str, list[int]] = {}
    for position in template:
        by_kind.setdefault(entries[position].base, []).append(entries[position].counter)
    before: dict[str, list[int]] = {}
    for position in previous:
        before.setdefault(entries[position].base, []).append(entries[position].counter)
    after: dict[str, int] = {}
    for entry in entries[template[-1] + 1:]:
        if not entry.placeholder:
            after.setdefault(entry.base, entry.counter)
    if set(before) != set(by_kind):
        raise _CannotExpand("the last two traced blocks run different kinds of nodes")
    steps = {}
    for kind, counters in by_kind.items():
        step = len(counters)
        if counters != list(range(counters[0], counters[0] + step)) or \
                before[kind] != [counter - step for counter in counters]:
            raise _CannotExpand(f"the blocks' '{kind}' nodes are not numbered consecutively")
        if kind in after and after[kind] != counters[-1] + 1:
            raise _CannotExpand(f"the '{kind}' nodes after the blocks are not numbered on from the last block's")
        steps[kind] = step
    return steps


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _renamed(name: str, old_path: str, new_path: str) -> str:
    """A parameter placeholder's name for another block: export spells `layers.1.attn.w` as
    `p_layers_1_attn_w`."""
    old, new = f"_{old_path.replace('.', '_')}_", f"_{new_path.replace('.', '_')}_"
    if old not in name:
        raise _CannotExpand(f"placeholder {name} does not spell its module path")
    return name.replace(old, new, 1)


def _owners(entries: list[_Entry], paths: list[str]) -> list[int | None]:
    """Which traced block each non-placeholder entry belongs to (None: none); entries inside a
    block's span join it, as blocks.py closes gaps."""
    owners: list[int | None] = []
    for entry in entries:
        owner = None
        if not entry.placeholder and entry.module_path:
            owner = next((index for index, path in enumerate(paths) if _under(entry.module_path, path)), None)
        owners.append(owner)
    for index in range(len(paths)):
        positions = [position for position, owner in enumerate(owners) if owner == index]
        for position in range(positions[0], positions[-1] + 1) if positions else ():
            if not entries[position].placeholder and owners[position] is None:
                owners[position] = index
    return owners


def _shifted_path(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if _under(path, old) else path


def _expand_one(entries: list[_Entry], blocks: RepeatedBlocks, infos: dict[str, ParamInfo]) -> list[_Entry]:
    paths = [blocks.path(index) for index in range(CAPTURED_CHILDREN)]
    last = CAPTURED_CHILDREN - 1
    previous_path, template_path = paths[last - 1], paths[last]
    owners = _owners(entries, paths)
    spans = [[position for position, owner in enumerate(owners) if owner == index] for index in range(len(paths))]
    if not all(spans):
        raise _CannotExpand(f"a block of {blocks.container} runs no ops")
    body = [position for position, entry in enumerate(entries) if not entry.placeholder]
    inside = body[body.index(spans[0][0]):body.index(spans[-1][-1]) + 1]
    if inside != [position for span in spans for position in span]:
        raise _CannotExpand(f"ops run between the blocks of {blocks.container}")
    calls = [[entries[p].node for p in span if entries[p].node is not None and entries[p].node.kind == "call"]
             for span in spans]
    if any([node.target for node in calls[0]] != [node.target for node in other] for other in calls[1:]):
        raise _CannotExpand(f"the blocks of {blocks.container} run different ops")
    params = [_block_params(entries, paths[index], paths[index + 1]) for index in range(last)]
    _check_recurrence(calls, params, paths)
    template = [entries[p] for p in spans[last]]
    steps = _counter_steps(entries, spans[last - 1], spans[last])
    earlier = {node.name for block in calls[:last] for node in block}
    constants = {entry.name for entry in entries if entry.placeholder and entry.node is not None
                 and entry.node.kind == "constant"}
    for position, entry in enumerate(entries):
        if entry.node is None:
            continue
        if owners[position] is None and any(source in earlier for source in entry.node.inputs):
            raise _CannotExpand(f"{entry.name} reads a block of {blocks.container} other than the last")
        if owners[position] == last and any(source in constants for source in entry.node.inputs):
            raise _CannotExpand(f"{template_path} reads a tensor constant created in its forward")

    # Copies CAPTURED_CHILDREN..N-1 of the template, each reading the copy before it.
    pairs = params[-1]
    previous_calls = [node.name for node in calls[last]]
    previous_params = {rel: entry.name for rel, (_, entry) in pairs.items()}
    copies_body: list[_Entry] = []
    copies_params: dict[str, list[_Entry]] = {"param": [], "buffer": []}
    last_map: dict[str, str] = {}
    for index in range(CAPTURED_CHILDREN, blocks.num_children):
        path = blocks.path(index)
        mapping: dict[str, str] = {}
        new_params: dict[str, str] = {}
        for rel, (previous_entry, entry) in pairs.items():
            name = _renamed(entry.name, template_path, path)
            new_params[rel] = name
            mapping[entry.name] = name
            mapping[previous_entry.name] = previous_params[rel]
            node = replace(entry.node, name=name, target=f"{path}.{rel}")
            infos[name] = replace(infos[entry.name], name=node.target, node=name)
            copies_params[entry.node.kind].append(replace(entry, name=name, node=node))
        for source_name, previous in zip((node.name for node in calls[last - 1]), previous_calls):
            mapping[source_name] = previous
        for entry in template:
            mapping[entry.name] = f"{entry.name}#{path}"
        for entry in template:
            node = entry.node
            if node is not None:
                node = replace(node, name=mapping[entry.name], inputs=tuple(mapping.get(s, s) for s in node.inputs),
                               module_path=_shifted_path(node.module_path, template_path, path))
            counter = entry.counter + (index - last) * steps.get(entry.base, 0)
            copies_body.append(replace(entry, name=mapping[entry.name], counter=counter, node=node,
                                       module_path=_shifted_path(entry.module_path, template_path, path)))
        previous_calls = [mapping[node.name] for node in calls[last]]
        previous_params = new_params
        last_map = {entry.name: mapping[entry.name] for entry in template}
    shifts = {kind: (blocks.num_children - CAPTURED_CHILDREN) * step for kind, step in steps.items()}
    return _spliced(entries, owners, last, pairs, copies_params, copies_body, last_map, shifts)


def _check_recurrence(calls: list[list[OpNode]], params: list[dict], paths: list[str]) -> None:
    """The last traced block is the one before it shifted by one: mapping each of its inputs one
    block back (its own nodes and parameters to the previous block's, the previous block's to
    the one before, anything else to itself) gives the previous block's nodes exactly."""
    last = len(paths) - 1
    back: dict[str, str] = {}
    for index in (last, last - 1):
        for node, earlier in zip(calls[index], calls[index - 1]):
            back[node.name] = earlier.name
        for earlier_entry, entry in params[index - 1].values():
            back[entry.name] = earlier_entry.name
    older = {node.name for block in calls[:last - 1] for node in block}
    older |= {entry.name for pairs in params[:last - 1] for pair in pairs.values() for entry in pair}
    for node, previous in zip(calls[last], calls[last - 1]):
        if any(source in older and source not in back for source in node.inputs):
            raise _CannotExpand(f"{node.name} of {paths[last]} reads a block two or more before it")
        shifted = replace(node, name=previous.name, inputs=tuple(back.get(source, source) for source in node.inputs),
                          module_path=_shifted_path(node.module_path, paths[last], paths[last - 1]))
        if shifted != previous:
            raise _CannotExpand(f"{paths[last]} is not {paths[last - 1]} shifted by one block (at {node.name})")


def _block_params(entries: list[_Entry], first: str, second: str) -> dict[str, tuple[_Entry, _Entry]]:
    """Relative name -> (placeholder in block `first`, in block `second`) for every parameter and buffer."""
    found: dict[str, list] = {}
    for entry in entries:
        node = entry.node
        if not entry.placeholder or node is None or node.kind not in ("param", "buffer"):
            continue
        for index, path in enumerate((first, second)):
            if node.target.startswith(path + "."):
                found.setdefault(node.target[len(path) + 1:], [None, None])[index] = entry
    pairs = {}
    for rel, (first_entry, second_entry) in found.items():
        if first_entry is None or second_entry is None:
            raise _CannotExpand(f"parameter {rel} is in only one of two blocks")
        if _renamed(second_entry.name, second, first) != first_entry.name:
            raise _CannotExpand(f"placeholders {first_entry.name} and {second_entry.name} are not named alike")
        pairs[rel] = (first_entry, second_entry)
    return pairs



def _spliced(entries, owners, last, params, copies_params, copies_body, last_map, shifts) -> list[_Entry]:
    """Entries with the copies inserted after the second block's (placeholders after its
    placeholders of the same kind), and whatever followed the second block reading the last copy
    and numbered after the copies."""
    second_params = {entry.name: entry.node.kind for _, entry in params.values()}
    last_of_kind = {}
    for position, entry in enumerate(entries):
        if entry.name in second_params:
            last_of_kind[second_params[entry.name]] = position
    for kind, position in last_of_kind.items():
        run = [p for p, entry in enumerate(entries) if second_params.get(entry.name) == kind]
        if run != list(range(run[0], position + 1)):
            raise _CannotExpand(f"the second block's {kind}s are not contiguous")
    last_body = max(position for position, owner in enumerate(owners) if owner == last)
    spliced: list[_Entry] = []
    for position, entry in enumerate(entries):
        if owners[position] is None and entry.node is not None and not entry.placeholder and last_map:
            inputs = tuple(last_map.get(source, source) for source in entry.node.inputs)
            if inputs != entry.node.inputs:
                entry = replace(entry, node=replace(entry.node, inputs=inputs))
        if position > last_body and not entry.placeholder and shifts.get(entry.base):
            entry = replace(entry, counter=entry.counter + shifts[entry.base])
        spliced.append(entry)
        for kind, last in last_of_kind.items():
            if position == last:
                spliced.extend(copies_params[kind])
        if position == last_body:
            spliced.extend(copies_body)
    return spliced

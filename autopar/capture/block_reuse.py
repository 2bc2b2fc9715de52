"""Capture N identical blocks by tracing three periods of them (design principle 4).

torch.export's time grows with the model's depth: GPT-3 175B's 96 layers are 4,500 nodes to
trace although layers 1..95 are one layer 95 times. When block_match.py finds a container of
repeating children (from child `first` on, child i like child i + period), the model is
exported with its leading children and three periods only. The first period reads the
prologue (or the leading children); each child of the third must be its counterpart in the
second shifted by one period (the same ops, shapes, costs and arguments, each input read from
the child before it where the counterpart reads its own predecessor, or from the same place
outside the repeating children), which is the recurrence the copies follow: child i is copied
from the traced child of its phase in the third period, reading child i - 1, and what followed
the last traced child (the final norm, the head, the loss) reads the last copy. Parameters,
buffers and the tensor constants a block's forward lifts are copied per child.

The result is the graph the full capture gives, node for node: module paths, parameter names
and export's node names (`linear_17`: a counter per op kind in graph order, advanced by one
period's step per copied period) included, so plans, fingerprints and codegen's name matching
are unchanged. Anything that does not fit that picture (periods that differ, ops between
blocks, a head that reads an earlier block, constants lifted after the blocks, names export
did not number alike in the last two periods) returns None and the caller captures in full.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from autopar.capture.block_match import RepeatedBlocks, repeated_blocks
from autopar.capture.blocks import find_blocks_and_segments
from autopar.capture.export import capture_program, fx_module_path, targets_like_output
from autopar.capture.wrap import LOSS_WRAPPER_PREFIX
from autopar.errors import CaptureError
from autopar.capture.gradient_sums import with_gradient_sums
from autopar.graph import OpGraph, OpNode, ParamInfo

_COUNTER = re.compile(r"^(.*)_(\d+)$")


class _CannotExpand(Exception):
    """The reduced capture does not extend to all blocks; the caller captures in full."""


def capture_reusing_blocks(model: nn.Module, inputs: tuple, kwargs: dict, *, loss_fn=None, example_targets=None,
                           name: str = "", verbose: bool = False, strict: bool = False) -> OpGraph | None:
    """The OpGraph of `model` (as `capture` makes it) from a capture of three periods of each
    container of repeating children; None when no container qualifies or the shortcut does not apply.

    `model` and the inputs are the meta replica planning captures (they are traced as given).
    Unexpected errors of the shortcut itself also return None (the full capture then runs)
    unless `strict`."""

    log = _logger(verbose)
    started = time.perf_counter()
    repeated = repeated_blocks(model)
    if not repeated:
        return None
    log("capture: " + ", ".join(f"{r.num_children} blocks of {r.container!r} repeat (period {r.period}"
                                + (f" after {r.first} others" if r.first else "") + f"): tracing {r.num_captured}"
                                for r in repeated))
    try:
        with _truncated(model, repeated):
            targets = example_targets
            if loss_fn is not None and targets is None:
                targets = targets_like_output(model, inputs, kwargs)
            program, reduced = capture_program(model, inputs, kwargs, loss_fn=loss_fn, example_targets=targets,
                                               name=name, verbose=verbose, allow_fallback=False,
                                               gradient_sums=False)
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
            short._modules = dict(list(original._modules.items())[:blocks.num_captured])
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
    graph_names = [final[entry.name] for entry in entries if entry.node is not None]
    if len(set(graph_names)) != len(graph_names):  # symbolic-size nodes never reach the graph
        raise _CannotExpand("the copies' node names collide")
    nodes, params = [], []
    for entry in entries:
        node = entry.node
        if node is None:
            continue
        name, inputs = final[node.name], tuple(final[source] for source in node.inputs)
        if name != node.name or inputs != node.inputs:
            node = _replaced(node, name=name, inputs=inputs)
        nodes.append(node)
        if node.kind in ("param", "buffer"):
            params.append(_replaced(infos[entry.name], node=name))
    blocks, segments = find_blocks_and_segments(model, nodes)
    return with_gradient_sums(replace(reduced, nodes=tuple(nodes), params=tuple(params), blocks=blocks, segments=segments))


def _replaced(instance, **changes):
    """`dataclasses.replace` for the plain dataclasses copied here (OpNode, ParamInfo, _Entry: no
    __post_init__, InitVar or cached property): the instance's fields with `changes`, without
    running __init__ field by field, which was half of expand_blocks' time (15,000 copies for
    GPT-3 175B). The copy equals what replace() makes."""
    if not changes.keys() <= instance.__dict__.keys():
        raise TypeError(f"{type(instance).__name__} has no field {sorted(changes.keys() - instance.__dict__.keys())}")
    copied = object.__new__(type(instance))
    copied.__dict__.update(instance.__dict__)
    copied.__dict__.update(changes)
    return copied


def _split_counter(name: str) -> tuple[str, int]:
    """`linear_17` -> ("linear", 17); `linear` -> ("linear", 0)."""
    match = _COUNTER.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _spelled(entry: _Entry) -> str:
    return f"{entry.base}_{entry.counter}" if entry.counter else entry.base


def _counter_steps(entries: list[_Entry], previous: list[int], template: list[int]) -> dict[str, int]:
    """Per op kind, how far one more period of blocks advances export's name counter. torch.fx
    counts per kind in graph order, nodes it removes later included: the last traced period's
    numbers must be the previous period's shifted by one step per kind (gaps allowed where
    export removed symbolic-size nodes: BLOOM's blocks each lose four `mul`s, the first block of
    a Hugging Face Llama three that later blocks reuse, which is why the steps come from the
    last periods)."""
    by_kind: dict[str, list[int]] = {}
    for position in template:
        by_kind.setdefault(entries[position].base, []).append(entries[position].counter)
    before: dict[str, list[int]] = {}
    for position in previous:
        before.setdefault(entries[position].base, []).append(entries[position].counter)
    if set(before) != set(by_kind):
        raise _CannotExpand("the last two traced periods run different kinds of nodes")
    steps = {}
    for kind, counters in by_kind.items():
        earlier = before[kind]
        shifts = {counter - old for counter, old in zip(counters, earlier)}
        if len(earlier) != len(counters) or len(shifts) != 1 or counters != sorted(set(counters)) or min(shifts) <= 0:
            raise _CannotExpand(f"the blocks' '{kind}' nodes are not numbered alike")
        steps[kind] = shifts.pop()
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


def _owners(entries: list[_Entry], paths: dict[int, str]) -> list[int | None]:
    """Which traced child (index -> path) each non-placeholder entry belongs to (None: none);
    entries inside a child's span join it, as blocks.py closes gaps."""
    owners: list[int | None] = []
    for entry in entries:
        owner = None
        if not entry.placeholder and entry.module_path:
            owner = next((index for index, path in paths.items() if _under(entry.module_path, path)), None)
        owners.append(owner)
    for index in paths:
        positions = [position for position, owner in enumerate(owners) if owner == index]
        for position in range(positions[0], positions[-1] + 1) if positions else ():
            if not entries[position].placeholder and owners[position] is None:
                owners[position] = index
    return owners


def _shifted_path(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if _under(path, old) else path


def _placeholder_owners(entries: list[_Entry], paths: dict[int, str]) -> dict[str, int]:
    """Parameter, buffer and lifted-constant placeholder -> the traced child (index) it belongs to."""
    owners = {}
    for entry in entries:
        node = entry.node
        if entry.placeholder and node is not None and node.kind in _PER_CHILD_KINDS:
            owner = next((index for index, path in paths.items() if node.target.startswith(path + ".")), None)
            if owner is not None:
                owners[entry.name] = owner
    return owners


_PER_CHILD_KINDS = ("param", "buffer", "constant")
"""Placeholders each child has its own of: its parameters and buffers, and the tensors its
forward creates (`torch.tensor(...)`, which export lifts as constants: Falcon's attention)."""


def _constant_step(entries: list[_Entry], owners: dict[str, int], templates: list[int], period: int) -> int:
    """How far one period advances the counter of lifted constants (`..._lifted_tensor_4`):
    export numbers them in one sequence over the whole model, so a copy's are renumbered."""
    counters: dict[int, list[int]] = {}
    for entry in entries:
        if owners.get(entry.name) is not None and entry.node.kind == "constant":
            counters.setdefault(owners[entry.name], []).append(_split_counter(entry.node.target)[1])
    if not counters:
        return 0
    steps = set()
    for template in templates:
        now, before = counters.get(template, []), counters.get(template - period, [])
        if len(now) != len(before):
            raise _CannotExpand("the blocks lift different numbers of tensor constants")
        steps |= {new - old for new, old in zip(now, before)}
    if len(steps) != 1:
        raise _CannotExpand("the blocks' lifted tensor constants are not numbered alike")
    step = steps.pop()
    highest = max(counter for values in counters.values() for counter in values)
    for entry in entries:  # constants after the blocks would be renumbered too
        if (entry.placeholder and entry.node is not None and entry.node.kind == "constant"
                and entry.name not in owners and _split_counter(entry.node.target)[1] > highest - step):
            raise _CannotExpand(f"{entry.node.target} is lifted after the blocks")
    return step


def _moved(name: str, kind: str, old_path: str, new_path: str, constant_shift: int) -> str:
    """A child's placeholder name for another child (`constant_shift`: how far its counter moves)."""
    name = _renamed(name, old_path, new_path)
    if kind != "constant" or not constant_shift:
        return name
    base, counter = _split_counter(name)
    return f"{base}_{counter + constant_shift}"


def _expand_one(entries: list[_Entry], blocks: RepeatedBlocks, infos: dict[str, ParamInfo]) -> list[_Entry]:
    """`entries` with children num_captured..N-1 of `blocks` copied in: child i from the traced
    child of its phase in the last traced period (blocks.template(i)), reading child i - 1
    where that one reads the child before it."""
    first, period, captured = blocks.first, blocks.period, blocks.num_captured
    run = range(first, captured)
    paths = {index: blocks.path(index) for index in run}
    owners = _owners(entries, paths)
    spans = {index: [position for position, owner in enumerate(owners) if owner == index] for index in run}
    if not all(spans.values()):
        raise _CannotExpand(f"a block of {blocks.container} runs no ops")
    body = [position for position, entry in enumerate(entries) if not entry.placeholder]
    inside = body[body.index(spans[first][0]):body.index(spans[captured - 1][-1]) + 1]
    if inside != [position for index in run for position in spans[index]]:
        raise _CannotExpand(f"ops run between the blocks of {blocks.container}")
    calls = {index: [entries[p].node for p in spans[index]
                     if entries[p].node is not None and entries[p].node.kind == "call"] for index in run}
    for index in run:
        if index + period in paths and [n.target for n in calls[index]] != [n.target for n in calls[index + period]]:
            raise _CannotExpand(f"the blocks of {blocks.container} run different ops")
    param_owner = _placeholder_owners(entries, paths)
    templates = [blocks.template(index) for index in range(captured - period, captured)]
    constant_step = _constant_step(entries, param_owner, templates, period)
    kinds = {entry.name: entry.node.kind for entry in entries if entry.name in param_owner}
    for template in templates:
        _check_recurrence(calls, param_owner, kinds, paths, template, period, constant_step)
    steps = _counter_steps(entries, [p for index in templates for p in spans[index - period]],
                           [p for index in templates for p in spans[index]])
    earlier = {node.name for index in run if index != captured - 1 for node in calls[index]}
    constants = {entry.name for entry in entries if entry.placeholder and entry.node is not None
                 and entry.node.kind == "constant" and entry.name not in param_owner}
    for position, entry in enumerate(entries):
        if entry.node is None:
            continue
        if owners[position] is None and any(source in earlier for source in entry.node.inputs):
            raise _CannotExpand(f"{entry.name} reads a block of {blocks.container} other than the last")
        if owners[position] in templates and any(source in constants for source in entry.node.inputs):
            raise _CannotExpand(f"{paths[owners[position]]} reads a tensor constant lifted outside the blocks")

    by_child_params: dict[int, list[_Entry]] = {}
    for entry in entries:
        if entry.name in param_owner:
            by_child_params.setdefault(param_owner[entry.name], []).append(entry)
    child_calls = {index: [node.name for node in calls[index]] for index in run}
    copies_body: list[_Entry] = []
    copies_params: dict[str, list[_Entry]] = {kind: [] for kind in _PER_CHILD_KINDS}
    last_map: dict[str, str] = {}
    for index in range(captured, blocks.num_children):
        template = blocks.template(index)
        path, template_path = blocks.path(index), paths[template]
        source_path, previous_path = paths[template - 1], blocks.path(index - 1)
        mapping: dict[str, str] = {}
        shift = (index - template) // period
        for entry in by_child_params.get(template, ()):
            kind = entry.node.kind
            name = _moved(entry.name, kind, template_path, path, shift * constant_step)
            mapping[entry.name] = name
            target = path + entry.node.target[len(template_path):]
            if kind == "constant":
                target = f"{_split_counter(target)[0]}_{_split_counter(target)[1] + shift * constant_step}"
            node = _replaced(entry.node, name=name, target=target)
            if kind != "constant":
                infos[name] = _replaced(infos[entry.name], name=node.target, node=name)
            copies_params[kind].append(_replaced(entry, name=name, node=node))
        for entry in by_child_params.get(template - 1, ()):
            mapping[entry.name] = _moved(entry.name, entry.node.kind, source_path, previous_path, shift * constant_step)
        for source, previous in zip(child_calls[template - 1], child_calls[index - 1]):
            mapping[source] = previous
        for position in spans[template]:
            mapping[entries[position].name] = f"{entries[position].name}#{path}"
        for position in spans[template]:
            entry = entries[position]
            node = entry.node
            if node is not None:
                node = _replaced(node, name=mapping[entry.name], inputs=tuple(mapping.get(s, s) for s in node.inputs),
                                 module_path=_shifted_path(node.module_path, template_path, path))
            counter = entry.counter + shift * steps.get(entry.base, 0)
            copies_body.append(_replaced(entry, name=mapping[entry.name], counter=counter, node=node,
                                         module_path=_shifted_path(entry.module_path, template_path, path)))
        child_calls[index] = [mapping[name] for name in child_calls[template]]
        last_map = {entries[position].name: mapping[entries[position].name] for position in spans[template]}
    num_periods = (blocks.num_children - captured) // period
    shifts = {kind: num_periods * step for kind, step in steps.items()}
    return _spliced(entries, owners, captured - 1, set(param_owner), copies_params, copies_body, last_map, shifts)


def _check_recurrence(calls: dict[int, list[OpNode]], param_owner: dict[str, int], kinds: dict[str, str],
                      paths: dict[int, str], template: int, period: int, constant_step: int) -> None:
    """Traced child `template` is child `template - period` shifted by one period: mapping each
    of its inputs one period back (its own nodes and parameters, and those of the child before
    it, to the children `period` earlier; anything outside the repeating children to itself)
    gives that child's nodes exactly. It reads no repeating child but itself and the one before."""
    previous = template - period
    back: dict[str, str] = {}
    for index in (template, template - 1):
        for node, earlier in zip(calls[index], calls[index - period]):
            back[node.name] = earlier.name
    for name, owner in param_owner.items():
        if owner in (template, template - 1):
            back[name] = _moved(name, kinds[name], paths[owner], paths[owner - period], -constant_step)
    known = {node.name for nodes in calls.values() for node in nodes} | set(param_owner)
    for node, shifted_to in zip(calls[template], calls[previous]):
        if any(source in known and source not in back for source in node.inputs):
            raise _CannotExpand(f"{node.name} of {paths[template]} reads a block two or more before it")
        shifted = _replaced(node, name=shifted_to.name,
                            inputs=tuple(back.get(source, source) for source in node.inputs),
                            module_path=_shifted_path(node.module_path, paths[template], paths[previous]))
        if shifted != shifted_to:
            raise _CannotExpand(f"{paths[template]} is not {paths[previous]} shifted by one period (at {node.name})")


def _spliced(entries, owners, last, block_params, copies_params, copies_body, last_map, shifts) -> list[_Entry]:
    """Entries with the copies inserted after the last traced child's (placeholders after the
    traced children's placeholders of the same kind), and whatever followed that child reading
    the last copy and numbered after the copies."""
    runs: dict[str, list[int]] = {}
    for position, entry in enumerate(entries):
        if entry.name in block_params:
            runs.setdefault(entry.node.kind, []).append(position)
    for kind, run in runs.items():
        if run != list(range(run[0], run[-1] + 1)):
            raise _CannotExpand(f"the traced blocks' {kind}s are not contiguous")
    last_of_kind = {kind: run[-1] for kind, run in runs.items()}
    last_body = max(position for position, owner in enumerate(owners) if owner == last)
    spliced: list[_Entry] = []
    for position, entry in enumerate(entries):
        if owners[position] is None and entry.node is not None and not entry.placeholder and last_map:
            inputs = tuple(last_map.get(source, source) for source in entry.node.inputs)
            if inputs != entry.node.inputs:
                entry = _replaced(entry, node=_replaced(entry.node, inputs=inputs))
        if position > last_body and not entry.placeholder and shifts.get(entry.base):
            entry = _replaced(entry, counter=entry.counter + shifts[entry.base])
        spliced.append(entry)
        for kind, last_position in last_of_kind.items():
            if position == last_position:
                spliced.extend(copies_params[kind])
        if position == last_body:
            spliced.extend(copies_body)
    return spliced

"""A condensed graph for costing: of N identical blocks keep the first two.

Block 0 reads from the prologue and block 1 from a block, so together they show every edge
kind the other blocks have; block 1 then stands for blocks 1..N-1 (node weight N - 1). Whatever
read the last block (the epilogue) reads block 1 instead. The intra-op solver multiplies by the
weights, and `expand_segments` copies block 1's cost to blocks 2..N-1. Planning a 96-layer
model then costs little more than planning a 2-layer one.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.graph import BlockGroup, OpGraph
from autopar.solver.evaluate import SegmentCost


def condense(graph: OpGraph) -> OpGraph:
    dropped: set[str] = set()
    redirect: dict[str, str] = {}
    weights: dict[str, int] = {}
    groups = []
    stand_ins: dict[str, str] = {}
    condensed = _condensable(graph)
    for group in graph.blocks:
        if id(group) not in condensed:
            groups.append(group)
            continue
        last = group.nodes[-1]
        for position, name in enumerate(last):
            redirect[name] = group.nodes[1][position]
        for names in group.nodes[2:]:
            dropped.update(names)
            _stand_in(graph, names, group.nodes[1], stand_ins)
        for name in group.nodes[1]:
            weights[name] = group.num_instances - 1
        groups.append(replace(group, nodes=group.nodes[:2]))
    if not dropped:
        return graph
    params_dropped = _params_only_used_by(graph, dropped)
    _weigh_params(graph, groups, weights)
    nodes = []
    for node in graph.nodes:
        if node.name in dropped or node.name in params_dropped:
            continue
        inputs = tuple(redirect.get(source, source) for source in node.inputs)
        nodes.append(node if inputs == node.inputs else replace(node, inputs=inputs))
    segments = tuple(segment for segment in graph.segments if not (set(segment.nodes) & dropped))
    params = tuple(param for param in graph.params if param.node not in params_dropped)
    return replace(graph, nodes=tuple(nodes), params=params, blocks=tuple(groups), segments=segments,
                   node_weights=weights, stand_ins=stand_ins)


def _condensable(graph: OpGraph) -> set[int]:
    """ids of the groups of 3 or more blocks that condense: blocks 0 and 1 of each are kept, blocks
    2..N-1 dropped (the last one's readers redirected to block 1). Where two kinds of block
    alternate (GPT-OSS's windowed and full layers, A B A B ...) both condense together: block 1 of
    one kind may feed a kept block of the other. A group whose later blocks feed a node that stays
    (an op between blocks in the parent's forward, a kept block of another kind: A A B A A B ...)
    is kept whole, and so, in turn, are the groups that relied on it."""
    candidates = [group for group in graph.blocks if group.num_instances >= 3]
    while True:
        kept = {name for group in candidates for names in group.nodes[:2] for name in names}
        dropped = {name for group in candidates for names in group.nodes[2:] for name in names}
        fit = [group for group in candidates if _read_only_by_condensed(graph, group, kept, dropped)]
        if len(fit) == len(candidates):
            return {id(group) for group in fit}
        candidates = fit


def _read_only_by_condensed(graph: OpGraph, group: BlockGroup, kept: set[str], dropped: set[str]) -> bool:
    """Block 1 feeds only kept blocks or dropped ones, blocks 2..N-2 only dropped ones: after
    condensing, every remaining node's inputs remain (or are redirected, from a last block)."""
    second = set(group.nodes[1])
    later = {name for names in group.nodes[2:-1] for name in names}
    for node in graph.nodes:
        if node.name in dropped:
            continue
        for source in node.inputs:
            if source in later or (source in second and node.name not in kept):
                return False
    return True


def _stand_in(graph: OpGraph, names, kept_names, stand_ins: dict[str, str]) -> None:
    """Each dropped node, and each parameter it reads, maps to the same place in block 1."""
    for name, kept in zip(names, kept_names):
        stand_ins[name] = kept
        for source, kept_source in zip(graph[name].inputs, graph[kept].inputs):
            if graph[source].kind in ("param", "buffer", "constant") and source != kept_source:
                stand_ins.setdefault(source, kept_source)


def _params_only_used_by(graph: OpGraph, dropped: set[str]) -> set[str]:
    found = set()
    for param in graph.params:
        users = graph.consumers.get(param.node, ())
        if users and all(user in dropped for user in users):
            found.add(param.node)
    return found


def _weigh_params(graph: OpGraph, groups: list[BlockGroup], weights: dict[str, int]) -> None:
    """Parameters used only by block 1 stand for the same parameters of blocks 1..N-1."""
    for group in groups:
        if len(group.nodes) < 2 or group.nodes[1][0] not in weights:
            continue
        members = set(group.nodes[1])
        for param in graph.params:
            users = set(graph.consumers.get(param.node, ()))
            if users and users <= members:
                weights[param.node] = weights[group.nodes[1][0]]


def expand_segments(full: OpGraph, condensed: OpGraph, costs: list[SegmentCost]) -> list[SegmentCost]:
    """Costs per segment of the full graph: block 1's cost for every block after it."""
    by_name = {cost.name: cost for cost in costs}
    steady: dict[int, SegmentCost] = {}
    for group_index, group in enumerate(condensed.blocks):
        if len(group.nodes) >= 2 and group.instances[1] in by_name:
            steady[group_index] = by_name[group.instances[1]]
    expanded = []
    for segment in full.segments:
        if segment.name in by_name:
            expanded.append(by_name[segment.name])
        elif segment.block_group in steady:
            expanded.append(replace(steady[segment.block_group], name=segment.name))
        else:
            expanded.append(SegmentCost(name=segment.name))
    return expanded

"""The graph with repeated blocks folded onto one template (solve one block, reuse for all).

Every node of instance k of a block group maps to the node at the same position of instance 0
(the template), with the weight of a condensed graph's node (condense.py) counted in, and each parameter used by only one instance maps to the template's parameter
at the same input slot. Edges are counted with multiplicity: inside the template x N, from
block k-1's output into block k x (N-1), from the prologue into block 0 x 1. Identical blocks
then share one strategy choice, and the ILP's costs (x multiplicity) are those of the whole model.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from autopar.graph import OpGraph


@dataclass(frozen=True)
class QuotientEdge:
    producer: str
    consumer: str
    input_index: int


@dataclass
class Quotient:
    """Representative nodes, how many originals each stands for, and edges with multiplicity."""

    rep: dict[str, str]
    """Original node -> its representative (itself outside repeated blocks)."""
    count: Counter
    """Representative -> number of original nodes it stands for."""
    edges: Counter
    """QuotientEdge -> multiplicity."""
    order: list[str]
    """Representatives in topological order."""

    def producers_of(self, consumer: str, input_index: int) -> list[str]:
        return [edge.producer for edge in self.edges if edge.consumer == consumer and edge.input_index == input_index]


def fold_blocks(graph: OpGraph, *, enabled: bool = True) -> Quotient:
    rep = {node.name: node.name for node in graph.nodes}
    if enabled:
        _map_instances(graph, rep)
    count: Counter = Counter()
    for node in graph.nodes:
        count[rep[node.name]] += graph.weight(node.name)
    edges: Counter = Counter()
    for node in graph.nodes:
        if node.kind == "output":
            continue
        for index, producer in enumerate(node.inputs):
            edges[QuotientEdge(rep[producer], rep[node.name], index)] += graph.weight(node.name)
    order = [node.name for node in graph.nodes if rep[node.name] == node.name]
    return Quotient(rep=rep, count=count, edges=edges, order=order)


def _map_instances(graph: OpGraph, rep: dict[str, str]) -> None:
    owner_of_param = _param_owners(graph)
    for group in graph.blocks:
        if group.num_instances < 2:
            continue
        start = _first_typical_instance(graph, group)
        if group.num_instances - start < 2:
            continue
        template = group.nodes[start]
        for instance, names in zip(group.instances[start:], group.nodes[start:]):
            for position, name in enumerate(names):
                rep[name] = template[position]
                _map_params(graph, name, template[position], instance, group.instances[start], owner_of_param, rep)


def _first_typical_instance(graph: OpGraph, group) -> int:
    """0, or 1 where block 0 computes fewer gradients than block 1: a block reading the model's input
    (no embedding before it) needs no input gradient, so it is not a template for the rest and
    stays unfolded (folded onto it, every block would be priced without its first input gradient)."""
    def grads(name: str) -> tuple[bool, ...]:
        return tuple(graph[source].requires_grad for source in graph[name].inputs)

    differs = any(grads(a) != grads(b) for a, b in zip(group.nodes[0], group.nodes[1]))
    return 1 if differs else 0


def _param_owners(graph: OpGraph) -> dict[str, set[str]]:
    """Parameter node -> the block instances (or "" for outside) whose ops use it."""
    instance_of: dict[str, str] = {}
    for group in graph.blocks:
        for instance, names in zip(group.instances, group.nodes):
            for name in names:
                instance_of[name] = instance
    owners: dict[str, set[str]] = defaultdict(set)
    for node in graph.calls():
        for source in node.inputs:
            if graph[source].kind in ("param", "buffer", "constant"):
                owners[source].add(instance_of.get(node.name, ""))
    return owners


def _map_params(graph: OpGraph, name: str, template_name: str, instance: str, template_instance: str,
                owners: dict[str, set[str]], rep: dict[str, str]) -> None:
    node, template_node = graph[name], graph[template_name]
    for source, template_source in zip(node.inputs, template_node.inputs):
        producer = graph[source]
        if producer.kind not in ("param", "buffer", "constant") or source == template_source:
            continue
        if owners[source] == {instance} and owners[template_source] == {template_instance}:
            rep[source] = template_source

"""Tensors written in place, and every tensor that shares their storage: never redistributed.

An in-place op (`copy_`, `index_put_`, `add_`...: aten names them with a trailing underscore)
writes into its first argument, which is often a view of a bigger tensor: Hugging Face's linear
attention fills its output chunk by chunk (`core_attn_out[:, :, i] = ...`: select + slice views,
then `copy_` into them). Codegen runs the graph on DTensors, and a redistribution makes a new
tensor: if the base, a view or the written tensor is moved to another placement on its way to
the writer, the write lands in that copy and the base keeps its old values. The step runs to the
end and the loss is silently wrong (Qwen3.5 and Kimi Linear under tp=2 did so: the gated delta
rule's output stayed zero on every rank).

So an alias family that something writes in place is read by every consumer in the placement its
producer gave it (`aliases_written_in_place`; the solver forbids any other move of it). Since an
in-place op has no sharding rule of its own, the family ends up replicated; the plan report lists
the in-place ops (`copy_ x132`) among those replicated for want of a rule.
"""

from __future__ import annotations

from autopar.graph import OpGraph, OpNode, Ref


def writes_in_place(node: OpNode) -> bool:
    """Whether the op writes into its first argument (aten's in-place overloads: `copy_`,
    `index_put_`, `add_`; not the dunders `__and__`, `__or__`)."""
    if node.kind != "call" or node.target.count(".") != 2:
        return False
    name = node.target.split(".")[1]
    return name.endswith("_") and not name.endswith("__")


def aliases_written_in_place(graph: OpGraph) -> frozenset[str]:
    """Names of the nodes whose outputs share storage with a tensor some op writes in place: the
    written tensor, the views it is a view of up to their base, every other view of those, and
    the in-place ops' own outputs (aliases of what they wrote)."""
    views_of: dict[str, list[str]] = {}
    for node in graph.calls():
        if node.alias_input is not None and node.alias_input < len(node.inputs):
            views_of.setdefault(node.inputs[node.alias_input], []).append(node.name)
    written = [node for node in graph.calls() if writes_in_place(node)]
    pending = [name for node in written for name in (node.name, _written_input(node)) if name]
    family: set[str] = set()
    by_name = graph.by_name
    while pending:
        name = pending.pop()
        if name in family or name not in by_name:
            continue
        family.add(name)
        node = by_name[name]
        if node.kind == "call" and node.alias_input is not None and node.alias_input < len(node.inputs):
            pending.append(node.inputs[node.alias_input])
        pending.extend(views_of.get(name, ()))
    return frozenset(family)


def _written_input(node: OpNode) -> str:
    """The name of the tensor an in-place op writes ("" when its first argument is no tensor)."""
    first = node.args[0] if node.args else None
    if isinstance(first, Ref) and first.index < len(node.inputs):
        return node.inputs[first.index]
    return ""

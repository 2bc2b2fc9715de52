"""Readable summaries of an OpGraph (`autopar graph`)."""

from __future__ import annotations

from collections import Counter

from autopar.graph import OpGraph
from autopar.validation import human_bytes, human_count


def graph_summary(graph: OpGraph, *, top_ops: int = 8) -> str:
    calls = list(graph.calls())
    counts = Counter(node.target for node in calls)
    op_mix = ", ".join(f"{name.removeprefix('aten.')} x{count}" for name, count in counts.most_common(top_ops))
    lines = [
        f"model {graph.model_name or '(unnamed)'}: captured with {graph.capture_method}, "
        f"batch {graph.batch_size} ({'dynamic' if graph.batch_dynamic else 'fixed'})",
        f"  ops: {len(calls)} ({op_mix})",
        f"  parameters: {graph.num_params:,} ({human_bytes(graph.param_bytes)})",
        f"  forward: {human_count(graph.fwd_flops, 'FLOP')}, backward: {human_count(graph.bwd_flops, 'FLOP')}",
        f"  saved activations: {human_bytes(graph.saved_activation_bytes())}",
    ]
    for index, group in enumerate(graph.blocks):
        lines.append(f"  block {index}: {group.container}[{group.instances[0].rsplit('.', 1)[-1]}..] "
                     f"x{group.num_instances} identical, {len(group.template)} ops each")
    segment_names = [segment.name for segment in graph.segments]
    lines.append(f"  segments: {len(segment_names)} ({', '.join(segment_names[:3])}{', ...' if len(segment_names) > 3 else ''})")
    for note in graph.notes[:5]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)

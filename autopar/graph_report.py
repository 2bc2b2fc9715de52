"""Readable summaries of an OpGraph."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.graph import OpGraph


def human_count(value: float, unit: str = "") -> str:
    for threshold, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def human_bytes(value: float) -> str:
    for threshold, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}"
    return f"{value:.0f} B"


def graph_summary(graph: "OpGraph", *, top_ops: int = 8) -> str:
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

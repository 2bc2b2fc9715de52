"""Matplotlib pictures of a plan: the step timeline and the memory per stage.

The figures draw the layouts of timeline.py and memory.py and nothing else. Every drawn
collection carries a gid naming what it shows ("forward:3" is rank 3's forward passes,
"memory:activations" the activation parts of all bars), so tests read the picture back.
Uses the Agg canvas directly (no pyplot state, no display).
"""

from __future__ import annotations

from pathlib import Path

from autopar.validation import human_bytes
from autopar.plans.plan import Plan
from autopar.report.memory import MemoryChart, memory_layout
from autopar.report.timeline import PASS_KINDS, TAIL_KINDS, Timeline, layout

PASS_COLORS = {"forward": ("#1f5fa8", "#4f8fd8", "#8db9ea", "#bcd6f4"),
               "backward": ("#1d7a46", "#3fa86b", "#7fcb9b", "#b5e3c4"),
               "recompute": ("#c77d12", "#e0a13f", "#eec47e", "#f6dfb6"),
               "weight": ("#0f6e6e", "#2f9e9e", "#72c6c6", "#b0e0e0")}
"""Per pass kind, one shade per model chunk (darkest: the rank's first chunk)."""
TAIL_COLORS = {"dp.gradient_sync": "#d9622b", "dp.all_gather.once": "#e8894f", "dp.reduce_scatter.once": "#c2481a",
               "dp.all_gather.sm_contention.once": "#f0a878", "dp.reduce_scatter.sm_contention.once": "#d9775a",
               "pp.tied_weights": "#b04a9c", "optimizer": "#6b6b6b", "weight_cast": "#4a7fb0", "gradient_accumulate": "#7a9a3a", "offload.cpu_adam": "#8a8a3a"}
AXIS_COLORS = {"tp": "#7b3fb5", "cp": "#2a9d8f", "pp": "#c0392b", "dp": "#d9622b", "offload": "#8a8a3a"}
BUBBLE_COLOR = "#eeeeee"
MEMORY_COLORS = {"parameters": "#1f5fa8", "gradients": "#3fa86b", "optimizer": "#8e6bbf",
                 "weight_copies": "#7fa6d6", "activations": "#e0a13f", "buffers": "#8c8c8c", "recompute_workspace": "#c0392b",
                 "gradient_workspace": "#e07b7b",
                 "fsdp_unsharded": "#2a9d9d", "fragmentation": "#b8b8b8", "cuda_context": "#555555"}
_BAR_HEIGHT = 0.8
_COMM_HEIGHT = 0.18
_MIN_LABEL_FRACTION = 0.012
"""Blocks narrower than this share of the axis get no microbatch number."""


def timeline_figure(plan: Plan, timeline: Timeline | None = None, *, zoom: bool = True):
    """The step per pipeline rank; below it, when blocks are too narrow to read, the first
    passes enlarged."""
    from matplotlib.figure import Figure

    timeline = timeline or layout(plan)
    passes = sum(1 for block in timeline.blocks if block.kind == "forward" and block.rank == 0)
    zoomed = zoom and passes > 24
    rows = timeline.num_ranks
    height = 2.0 + max(0.32 * rows, 0.8) * (2 if zoomed else 1)
    figure = Figure(figsize=(14, height), dpi=110, layout="constrained")
    axes = figure.subplots(2 if zoomed else 1, 1, squeeze=False)[:, 0]
    _draw_timeline(axes[0], timeline, 0.0, timeline.end_s, labels=not zoomed)
    axes[0].set_title(_timeline_title(plan, timeline), fontsize=10, loc="left")
    if zoomed:
        window = _zoom_window(timeline)
        _draw_timeline(axes[1], timeline, 0.0, window, labels=True, gid_prefix="zoom.")
        axes[1].set_title(f"the first {window:.3g} s enlarged", fontsize=9, loc="left")
    _timeline_legend(figure, timeline)
    return figure


def _timeline_title(plan: Plan, timeline: Timeline) -> str:
    mesh = plan.mesh
    schedule = {"interleaved": f"interleaved 1F1B, {timeline.num_chunks} chunks per rank", "gpipe": "GPipe",
                "1f1b": "1F1B", "none": "no pipeline",
                "zb1p": f"zero-bubble ZB-1P, {timeline.num_chunks} chunk{'s' if timeline.num_chunks > 1 else ''} per rank",
                "zbv": "zero-bubble ZB-V (2 chunks per rank in a V)"}.get(plan.schedule, plan.schedule)
    return (f"{_short(plan.model)} on {plan.cluster}\npp={mesh['pp']} x dp={mesh['dp']} x tp={mesh['tp']}, {schedule}, "
            f"{plan.num_microbatches} microbatches of {plan.microbatch_size}, recompute={plan.recompute}, "
            f"ZeRO {plan.zero_stage}; step as drawn {timeline.end_s:.4g} s, predicted {plan.predicted.step_time_s:.4g} s "
            f"({100 * timeline.mismatch:+.2f}%)")


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."


def _zoom_window(timeline: Timeline) -> float:
    """Long enough to show the warmup of every rank and a few steady-state passes."""
    first_backward = min((b.start_s for b in timeline.blocks if b.kind == "backward" and b.rank == 0),
                         default=timeline.pipeline_end_s)
    steady = sorted(b.end_s for b in timeline.blocks if b.rank == 0 and b.kind == "backward")
    after = steady[min(len(steady) - 1, timeline.num_ranks)] if steady else first_backward
    return min(timeline.pipeline_end_s, max(first_backward, after) * 1.02)


def _draw_timeline(ax, timeline: Timeline, start_s: float, end_s: float, *, labels: bool, gid_prefix: str = "") -> None:
    span = max(end_s - start_s, 1e-12)
    for rank in range(timeline.num_ranks):
        y = rank - _BAR_HEIGHT / 2
        for kind in PASS_KINDS + ("bubble",) + TAIL_KINDS:
            blocks = [b for b in timeline.on_rank(rank, (kind,)) if b.start_s < end_s]
            if not blocks:
                continue
            colors = [_color(block) for block in blocks]
            collection = ax.broken_barh([(b.start_s, b.duration_s) for b in blocks], (y, _BAR_HEIGHT),
                                        facecolors=colors, edgecolor="white" if kind != "bubble" else BUBBLE_COLOR,
                                        linewidth=0.3)
            collection.set_gid(f"{gid_prefix}{kind}:{rank}")
            if labels and kind in PASS_KINDS:
                for block in blocks:
                    if block.duration_s / span >= _MIN_LABEL_FRACTION and block.end_s <= end_s:
                        ax.text(block.start_s + block.duration_s / 2, rank, str(block.microbatch), ha="center",
                                va="center", fontsize=6, color="white" if block.chunk < 2 else "black")
        _draw_comm(ax, timeline, rank, end_s, gid_prefix)
    ax.set_xlim(start_s, end_s)
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(timeline.num_ranks), [f"rank {rank}" for rank in range(timeline.num_ranks)], fontsize=7)
    ax.set_xlabel("seconds", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def _draw_comm(ax, timeline: Timeline, rank: int, end_s: float, gid_prefix: str) -> None:
    """A strip along the bottom of each pass: its exposed collectives, per mesh axis."""
    y = rank + _BAR_HEIGHT / 2 - _COMM_HEIGHT
    for axis_name, color in AXIS_COLORS.items():
        spans = []
        for block in timeline.on_rank(rank, PASS_KINDS):
            if block.start_s >= end_s:
                continue
            offset = sum(s for key, s in block.comm_s.items() if _axis_order(key) < _axis_order(axis_name))
            seconds = sum(s for key, s in block.comm_s.items() if key.split(".")[0] == axis_name)
            if seconds > 0:
                spans.append((block.end_s - offset - seconds, seconds))
        if spans:
            collection = ax.broken_barh(spans, (y, _COMM_HEIGHT), facecolors=color, linewidth=0)
            collection.set_gid(f"{gid_prefix}comm.{axis_name}:{rank}")


def _axis_order(key: str) -> int:
    """Strips stack from the block's end: pipeline sends last, tensor-parallel before them."""
    return {"pp": 0, "dp": 1, "tp": 2, "cp": 3, "offload": 4}.get(key.split(".")[0], 5)


def _color(block) -> str:
    if block.kind in PASS_COLORS:
        shades = PASS_COLORS[block.kind]
        return shades[block.chunk % len(shades)]
    return TAIL_COLORS.get(block.kind, BUBBLE_COLOR)


def _timeline_legend(figure, timeline: Timeline) -> None:
    from matplotlib.patches import Patch

    present = {block.kind for block in timeline.blocks}
    handles = [Patch(color=PASS_COLORS[kind][0], label=kind) for kind in PASS_KINDS if kind in present]
    handles += [Patch(color=BUBBLE_COLOR, label="bubble (idle)")] if timeline.bubbles else []
    axes_present = {key.split(".")[0] for block in timeline.blocks for key in block.comm_s}
    handles += [Patch(color=AXIS_COLORS[name], label="exposed offload copies" if name == "offload" else
                      f"exposed {name} collectives") for name in AXIS_COLORS if name in axes_present]
    handles += [Patch(color=TAIL_COLORS[kind], label=kind) for kind in TAIL_KINDS if kind in present]
    figure.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)


def memory_figure(plan: Plan, chart: MemoryChart | None = None):
    """Stacked memory per pipeline stage against the usable-memory line."""
    from matplotlib.figure import Figure

    chart = chart or memory_layout(plan)
    num = len(chart.bars)
    figure = Figure(figsize=(max(8.0, 0.55 * num + 3), 4.6), dpi=110, layout="constrained")
    ax = figure.subplots()
    gib = 2.0 ** 30
    bottoms = [0.0] * num
    names = list(dict.fromkeys(name for bar in chart.bars for name in bar.parts_bytes))
    for name in names:
        heights = [bar.parts_bytes.get(name, 0.0) / gib for bar in chart.bars]
        if not any(heights):
            continue
        container = ax.bar(range(num), heights, bottom=bottoms, color=MEMORY_COLORS.get(name, "#999999"),
                           label=name, width=0.7)
        for patch in container.patches:
            patch.set_gid(f"memory:{name}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    margins = [max(chart.usable_bytes / gib - b, 0.0) for b in bottoms]
    margin_bars = ax.bar(range(num), margins, bottom=bottoms, color="none", edgecolor="#9a9a9a", hatch="//",
                         linewidth=0.5, width=0.7, label="margin to usable")
    for patch in margin_bars.patches:
        patch.set_gid("memory:margin")
    line = ax.axhline(chart.usable_bytes / gib, color="black", linestyle="--", linewidth=1)
    line.set_gid("memory:usable")
    ax.text(num - 0.5, chart.usable_bytes / gib, f" usable {human_bytes(chart.usable_bytes)}", va="bottom",
            ha="right", fontsize=8)
    ax.set_xticks(range(num), [_stage_label(bar) for bar in chart.bars], fontsize=7,
                  rotation=0 if num <= 16 else 90)
    ax.set_ylabel("GiB per device", fontsize=9)
    ax.set_xlabel("pipeline stage (and its recomputation: sele. = selective, full. = full)", fontsize=8)
    ax.set_ylim(0, max(max(bottoms), chart.usable_bytes / gib) * 1.12)
    peak = chart.bars[chart.peak_stage]
    ax.set_title(f"{_short(plan.model)} on {plan.cluster}\nmemory per device by pipeline stage (peak stage {peak.stage}: "
                 f"{human_bytes(peak.total_bytes)} of {human_bytes(chart.usable_bytes)} usable)", fontsize=9, loc="left")
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return figure


def _stage_label(bar) -> str:
    return f"{bar.stage}" + ("" if bar.recompute == "none" else f"\n{bar.recompute[:4]}.")


def save_figure(figure, path: str | Path) -> None:
    """PNG, SVG or PDF by the file's suffix."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.savefig(str(path))

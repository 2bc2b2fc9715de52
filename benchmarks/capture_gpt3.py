"""How long does capturing GPT-3 take, and does a model on meta stay unallocated?

    .venv/bin/python benchmarks/capture_gpt3.py                  # gpt3-1.3b and gpt3-175b
    .venv/bin/python benchmarks/capture_gpt3.py gpt3-6.7b ...    # other model specs

Each model is built on meta and captured (`autopar.capture.capture`, torch.export with a dynamic
batch, example batch 2) in a fresh process, because peak RSS is per process and never goes down.
Columns: capture time (build + export + probing), peak RSS of the process and its growth over the
imports, graph nodes (all) and op nodes (calls), trainable parameters and forward matmul FLOPs at
the example batch. Goal for gpt3-175b: under 60 s and under 2 GB.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fresh_process import child_main, peak_rss_bytes, run_child  # noqa: E402

DEFAULT_SPECS = ("gpt3-1.3b", "gpt3-175b")


def measure(spec: str) -> dict:
    """Runs in the child process: build on meta, capture, report."""
    import torch

    from autopar.capture.export import capture
    from autopar.models import build_model

    torch.set_num_threads(1)
    baseline = peak_rss_bytes()
    started = time.perf_counter()
    bundle = build_model(spec)
    built = time.perf_counter()
    graph = capture(bundle.model, bundle.example_inputs, name=spec)
    finished = time.perf_counter()
    return dict(spec=spec, build_s=built - started, capture_s=finished - built, total_s=finished - started,
                peak_rss_bytes=peak_rss_bytes(), rss_growth_bytes=peak_rss_bytes() - baseline,
                num_nodes=len(graph.nodes), num_calls=sum(1 for _ in graph.calls()), num_params=graph.num_params,
                fwd_flops=graph.fwd_flops, batch_size=graph.batch_size,
                blocks=[f"{group.container} x{group.num_instances}" for group in graph.blocks])


def measured(spec: str) -> dict:
    row = run_child(__file__, spec)
    if "error" in row:
        raise SystemExit(f"capturing {spec} failed:\n{row['stderr']}")
    return row


def table(rows: list[dict]) -> str:
    header = ("model", "build (s)", "capture (s)", "total (s)", "peak RSS (GB)", "RSS growth (GB)", "nodes",
              "ops", "parameters", "fwd TFLOPs (batch 2)", "blocks")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = (row["spec"], f"{row['build_s']:.1f}", f"{row['capture_s']:.1f}", f"{row['total_s']:.1f}",
                 f"{row['peak_rss_bytes'] / 1e9:.2f}", f"{row['rss_growth_bytes'] / 1e9:.2f}", f"{row['num_nodes']:,}",
                 f"{row['num_calls']:,}", f"{row['num_params']:,}", f"{row['fwd_flops'] / 1e12:,.1f}",
                 ", ".join(row["blocks"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if child_main(argv, measure):
        return
    specs = argv or list(DEFAULT_SPECS)
    rows = [measured(spec) for spec in specs]
    print(table(rows))
    import torch

    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, one torch thread; each model in a fresh process")


if __name__ == "__main__":
    main(sys.argv[1:])

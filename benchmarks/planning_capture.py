"""How long capture for planning takes, and where its fixed costs go.

    .venv/bin/python benchmarks/planning_capture.py                  # planner_speed.py's two models
    .venv/bin/python benchmarks/planning_capture.py gpt3-175b ...    # other specs
    .venv/bin/python benchmarks/planning_capture.py --full-capture   # also trace every layer

`api.capture_for_planning(spec)` (what the capture column of planner_speed.py times, without
the search) in a fresh process per row, after importing torch and then torch._dynamo (which
export needs), each import timed on its own. Columns: the imports, the model's build on meta
(inside the capture), the capture (build, export of the traced children, probing and the
copies), as wall time and as this process's CPU time (a busy machine inflates wall time far
more), nodes, and how many children were traced. With `--full-capture` every spec gets a
second row that traces every layer, run right after the first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fresh_process import child_main, run_child  # noqa: E402

SPECS = (
    "gpt3-175b",
    "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,seq=8192,vocab=128256",
)


def measure(argument: str) -> dict:
    """Runs in the child process: `argument` is "SPEC" or "full:SPEC"."""
    full = argument.startswith("full:")
    spec = argument.removeprefix("full:")
    started = time.perf_counter(), time.process_time()
    import torch

    torch_imported = time.perf_counter(), time.process_time()
    import torch._dynamo  # noqa: F401 - export imports it on first use
    import torch.export  # noqa: F401

    dynamo_imported = time.perf_counter(), time.process_time()
    from autopar import api
    from autopar import models
    from autopar.capture.block_match import repeated_blocks

    torch.set_num_threads(1)
    building = models.build_model
    built: dict[str, float] = {}

    def timed_build(*args, **kwargs):
        begin = time.perf_counter(), time.process_time()
        bundle = building(*args, **kwargs)
        built["wall"], built["cpu"] = time.perf_counter() - begin[0], time.process_time() - begin[1]
        built["traced"] = ", ".join(f"{blocks.num_captured} of {blocks.num_children}"
                                    for blocks in repeated_blocks(bundle.model))
        return bundle

    models.build_model = timed_build
    begin = time.perf_counter(), time.process_time()
    graph = api.capture_for_planning(spec, reuse_blocks=not full, cache=False)  # cold: not from the capture cache
    wall, cpu = time.perf_counter() - begin[0], time.process_time() - begin[1]
    return dict(spec=spec, traced="every layer" if full else built["traced"],
                import_torch_s=torch_imported[0] - started[0], import_dynamo_s=dynamo_imported[0] - torch_imported[0],
                build_s=built["wall"], build_cpu_s=built["cpu"], capture_s=wall, capture_cpu_s=cpu,
                num_nodes=len(graph.nodes))


def table(rows: list[dict]) -> str:
    header = ("model", "children traced", "import torch (s)", "import torch._dynamo (s)", "build (s)",
              "build CPU (s)", "capture incl. build (s)", "capture CPU (s)", "nodes")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['spec']} | failed: {row['error']} |")
            continue
        label = row["spec"] if len(row["spec"]) < 20 else row["spec"].split(",")[0] + ",..."
        cells = (label, row["traced"], f"{row['import_torch_s']:.1f}", f"{row['import_dynamo_s']:.1f}",
                 f"{row['build_s']:.2f}", f"{row['build_cpu_s']:.2f}", f"{row['capture_s']:.1f}",
                 f"{row['capture_cpu_s']:.1f}", f"{row['num_nodes']:,}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if child_main(argv, measure):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=list(SPECS))
    parser.add_argument("--full-capture", action="store_true", help="also trace every layer")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.specs:
        for argument in (spec, f"full:{spec}") if args.full_capture else (spec,):
            row = run_child(__file__, argument)
            rows.append({"spec": spec, **row})
    print(table(rows))
    print(f"\n{os.cpu_count()} CPUs, one torch thread, each row in a fresh process")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a planning capture's time goes, per phase (wall and CPU), in this fresh process.

    .venv/bin/python benchmarks/capture_phases.py [MODEL]   # default gpt3-175b

Each phase is timed by wrapping the function that runs it. torch.export's stack (torch._dynamo
and friends) is imported before the capture so that its import is reported apart: inside
`autopar plan` the first export pays it. The capture cache is off: this is the cold capture.
"""

from __future__ import annotations

import functools
import sys
import time

totals: dict[str, tuple[float, float]] = {}


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def spent(start: tuple[float, float], end: tuple[float, float]) -> str:
    return f"{end[0] - start[0]:.2f} s wall, {end[1] - start[1]:.2f} s CPU"


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name by a wrapper adding its wall and CPU time to totals[label]."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return function(*args, **kwargs)
        finally:
            end = clock()
            wall_s, cpu_s = totals.get(label, (0.0, 0.0))
            totals[label] = (wall_s + end[0] - start[0], cpu_s + end[1] - start[1])

    setattr(owner, name, wrapper)


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "gpt3-175b"
    start = clock()
    import torch  # noqa: F401

    after_torch = clock()
    from autopar import api

    after_api = clock()
    import torch.export._trace  # noqa: F401

    after_export = clock()
    import autopar.capture.block_reuse as block_reuse
    import autopar.capture.export as capture
    import autopar.models as models

    timed(models, "build_model", "build the model on meta")
    timed(block_reuse, "repeated_blocks", "find the repeating blocks (block_match)")
    timed(capture, "export", "torch.export of the shortened model (dynamic batch)")
    timed(capture.ExportConverter, "convert", "ExportedProgram -> OpGraph, probing included")
    timed(capture, "probe_op", "probing ops on meta (inside the conversion)")
    timed(block_reuse, "expand_blocks", "copy the other blocks (expand_blocks)")
    timed(block_reuse, "find_blocks_and_segments", "block groups and segments (inside the copy)")
    before = clock()
    graph = api.capture_for_planning(spec, cache=False)
    after = clock()
    print(f"{spec}: {len(graph.nodes):,} nodes")
    print(f"import torch: {spent(start, after_torch)}")
    print(f"import autopar.api: {spent(after_torch, after_api)}")
    print(f"import torch.export._trace (torch._dynamo...): {spent(after_api, after_export)}")
    print(f"capture_for_planning: {spent(before, after)}")
    for label, (wall_s, cpu_s) in totals.items():
        print(f"  {label}: {wall_s:.2f} s wall, {cpu_s:.2f} s CPU")


if __name__ == "__main__":
    main()

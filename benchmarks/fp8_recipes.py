"""What each float8 recipe buys, measured against priced: torchao's README training table
(benchmarks/fp8_recipes.csv: one model, machine and configuration in bf16, tensorwise and rowwise).

    .venv/bin/python benchmarks/fp8_recipes.py [--breakdown]

The README does not say which H100 ran it, so each row is priced on the SXM part it names and on
the 500 W HBM2e part torchtitan's own tables ran on (published_fp8.csv's tt-* rows). The gain of a
recipe over bf16 (tokens/s against the bf16 row's) depends less on which part it was than the
throughput does: that gain, measured against priced, is what this compares. The rows are priced
with published_fp8.py's machinery (torchtitan's compiled casts); the reference numbers are only
read here, to compare.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.published_fp8 import _print_breakdown, evaluate_fp8, read_fp8_runs, recipe_of  # noqa: E402
from benchmarks.published_runs import Run, evaluate_run  # noqa: E402

REFERENCE = Path(__file__).resolve().with_suffix(".csv")
PARTS = {
    "H100 SXM (700 W)": {},
    "H100 HBM2e (500 W)": {"device": {"memory_gib": 95.0, "memory_bandwidth_gbs": 2400.0, "power_limit_w": 500.0}},
}
"""The parts the rows are priced on: as named, and torchtitan's power-capped machine."""


def predicted_tokens(run: Run, directory: Path, breakdown: bool) -> float:
    if run.precision == "bf16":
        return evaluate_run(run, directory).predicted
    outcome = evaluate_fp8(run, directory, with_bf16=False)
    if breakdown:
        _print_breakdown(outcome)
    return outcome.predicted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--breakdown", action="store_true", help="also print each float8 row's time breakdown")
    args = parser.parse_args()
    runs = read_fp8_runs(REFERENCE)
    baseline = next(run for run in runs if run.precision == "bf16")
    print("| part | run | recipe | published | predicted | error | measured gain | priced gain |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as directory:
        for part, overrides in PARTS.items():
            # a run of its own per part (published_fp8 keeps one planner per row id)
            priced = {run.id: predicted_tokens(replace(run, id=f"{run.id} on {part}", cluster_overrides=overrides),
                                               Path(directory), args.breakdown) for run in runs}
            for run in runs:
                recipe = "bf16" if run.precision == "bf16" else recipe_of(run)
                print(f"| {part} | {run.id} | {recipe} | {run.published:g} | {priced[run.id]:.4g} | "
                      f"{100 * (priced[run.id] / run.published - 1):+.1f}% | "
                      f"{run.published / baseline.published:.3f}x | {priced[run.id] / priced[baseline.id]:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

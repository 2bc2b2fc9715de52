"""Published, measured FP8 training runs (benchmarks/published_fp8.csv) against autopar's
prediction of the same configuration.

    .venv/bin/python benchmarks/published_fp8.py [--rows tt-8b-fsdp-8-fp8,...] [--breakdown] [--no-bf16] [--async-tp]

The rows are in shared/reference/published_runs.csv's format and are read, captured and priced
with benchmarks/published_runs.py's machinery (its Run, cluster TOML with the stated figures,
framework precision policy, recomputation mode and unit conversion), with precision "fp8": every
linear autopar's rule puts in float8 (solver/fp8.py; the output head stays bf16, as torchtitan's
filter and Megatron's output layer keep it), the row's scaling recipe (precision "fp8" is per-tensor,
"fp8-rowwise" torchao's rowwise), and the casts priced as the row's framework ran them, a stated
input of the price (cost_model/fp8.py HANDLINGS):

- torchtitan with torch.compile on (the notes say "torch.compile on"): "torchtitan", torchao's
  casts fused by inductor into an amax reduction and one scale-and-cast pass, the identical casts
  of each compiled block one (a shared input's, tensorwise grad_output's), and sequence-parallel
  inputs of column-parallel linears cast on their shard and all-gathered in float8; where the
  source names a torchao from before 2025-01-13 (TORCHAO_RECASTS_SINCE), "torchtitan-2024": its
  linear saved the float8 input and weight and cast grad_output once;
- NeMo / Megatron-Core (TransformerEngine): "te", per-tensor delayed scaling, one-pass casts with
  their transposes, grad_output cast once, norm-fed inputs written in float8 by the norm and
  gathered so under sequence parallelism, weights cast once per step and kept (memory), float8
  inputs saved for backward (memory); where the notes say current scaling (Megatron-Bridge's
  "fp8_cs", TransformerEngine 2.x), "te-current": an amax pass before each cast (after a norm, the
  norm's), the amax all-reduced over tp for sequence-parallel operands;
- otherwise "eager", autopar's own runtime (torchao without torch.compile).

Context parallelism is priced as the row's framework ran it too (published_runs.cp_kv_exchange_of:
torchtitan's is torch's `context_parallel`, its exchange waited where issued in the compiled blocks;
Megatron-Core's is Transformer Engine's ring); autopar's runtime columns price autopar's own.

Each row prints the prediction as run, the same configuration priced for autopar's runtime with
its casts compiled (its default on GPUs, codegen/fp8_compile.py) and eager (what the handling
changes), and in bf16 (what fp8 buys, modelled), with the predicted peak memory
against the measured one where the notes state it. The reference numbers are only read here, to
compare; the product never sees them.

Left out: torchtitan's Table 5 interleaved 1F1B row (128 tokens/s): how many stages each rank
held is set by split points the table does not state (torchtitan 9dec370's
pipeline_parallel_split_points has no default); its Tables 1 and 3 bf16 rows are not FP8 runs.
torchao's README float8 table (8 H100s, Llama 3 8B, tensorwise 7689.5 and rowwise 6768
tokens/s) does not say which H100 (SXM or the 500 W HBM2e part) ran it: fp8_recipes.py compares
its recipes' gains on both. DeepSeek-V3 (arXiv
2412.19437): its FP8 recipe is blockwise (1 x 128 activation tiles, 128 x 128 weight blocks), neither torchao's tensorwise nor rowwise, and the report gives GPU-hours
per trillion tokens on 2,048 H800s (a GPU autopar has no preset for) rather than a step time of a
stated configuration (the DualPipe schedule, MLA and the 61-layer MoE shape are not built-in).
torchtitan's June 2025 async TP table's float8 rowwise rows (70B on 256 H100 599.6 and 624.8 tokens/s,
8B on 64 H100 3,708.5 and 3,914.9, without and with async TP; the rows beside them are here as
tt25-*): the source calls its rowwise baseline under TP low and under investigation (torchtitan#1207:
rowwise ran at bf16's speed under TP 8, slower than bf16 at 8B; FSDP-only rowwise gains 1.10x,
fp8_recipes.py); torchao#2410 later found the cause in the small k and v projections, ~40% slower in
rowwise float8, a GEMM shape autopar does not price: it prices them 26-34% faster (docs/accuracy.md).
Megatron-Bridge's MoE FP8 rows are blockwise (DeepSeek-V3) or MoE shapes priced by published_moe.py.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autopar.solver.fp8 import Fp8Choice, fp8_linears  # noqa: E402
from autopar.solver.search import Planner, SearchOptions  # noqa: E402
from autopar.solver.step_model import Estimate  # noqa: E402
from benchmarks.published_runs import (Run, evaluate_run, planner_for, policy_of, read_runs,  # noqa: E402
                                       select_rows)

REFERENCE = Path(__file__).resolve().with_suffix(".csv")
_COMPILED = re.compile(r"\btorch\.compile on\b", re.IGNORECASE)
_TRANSFORMER_ENGINE = re.compile(r"\b(TransformerEngine|Megatron|NeMo)\b")
_CURRENT_SCALING = re.compile(r"\bcurrent[- ]scaling\b|\bFP8-CS\b|\bfp8_cs\b", re.IGNORECASE)
_TORCHAO_DATE = re.compile(r"\btorchao \w+ of (\d{4}-\d{2}-\d{2})\b")
TORCHAO_RECASTS_SINCE = "2025-01-13"
"""torchao's tensorwise Float8Linear saved its float8 input and weight for backward until
pytorch/ao#1461 and #1480 (2025-01-13), which save the high-precision ones and cast again in
backward (cost_model/fp8.py "torchtitan-2024" against "torchtitan")."""


def read_fp8_runs(path: Path = REFERENCE) -> list[Run]:
    """The rows of published_fp8.csv (attention as the row's framework ran it: published_runs.Run)."""
    return read_runs(path)


def recipe_of(run: Run) -> str:
    """torchao's recipe for the row's precision: "fp8-rowwise" is rowwise, "fp8" per-tensor."""
    if run.precision == "fp8-rowwise":
        return "rowwise"
    if run.precision != "fp8":
        raise ValueError(f"{run.id}: precision {run.precision!r} is not an fp8 precision (fp8, fp8-rowwise)")
    return "tensorwise"


def handling_of(run: Run) -> str:
    """How the row's framework ran its casts (see the module docstring)."""
    if _TRANSFORMER_ENGINE.search(run.source) or _TRANSFORMER_ENGINE.search(run.notes):
        return "te-current" if _CURRENT_SCALING.search(run.notes) else "te"
    if "torchtitan" in run.source.lower() and _COMPILED.search(run.notes):
        dated = _TORCHAO_DATE.search(run.source) or _TORCHAO_DATE.search(run.notes)
        return "torchtitan-2024" if dated and dated.group(1) < TORCHAO_RECASTS_SINCE else "torchtitan"
    return "eager"


_FP8_PLANNERS: dict[tuple[str, str, bool], Planner] = {}


def fp8_planner(run: Run, directory: Path, handling: str, async_tp: bool = False) -> Planner:
    """The row's capture and cluster (published_runs.planner_for's) priced in fp8; `async_tp`:
    a row that ran torch's async TP priced with it (PrecisionPolicy.with_torch_async_tp), not exposed."""
    key = (run.id, handling, async_tp)
    if key not in _FP8_PLANNERS:
        base = planner_for(run, directory)
        choice = Fp8Choice(recipe=recipe_of(run), linears=fp8_linears(base.graph), handling=handling)
        policy = policy_of(run).with_torch_async_tp() if async_tp and run.async_tp else policy_of(run)
        _FP8_PLANNERS[key] = Planner(base.graph, base.cluster, global_batch=run.global_batch, policy=policy,
                                     precision="fp8", fp8=choice,
                                     # as run: the row's context parallelism (published_runs.cp_kv_exchange_of);
                                     # autopar's runtime: its own (the planner's default)
                                     options=base.options if handling == handling_of(run) else SearchOptions())
    return _FP8_PLANNERS[key]


@dataclass(frozen=True, kw_only=True)
class Fp8Outcome:
    run: Run
    handling: str
    estimate: Estimate
    predicted: float
    error: float
    compiled: Estimate
    """The same configuration priced for autopar's runtime with its casts compiled."""
    eager: Estimate
    """The same configuration priced for autopar's runtime with eager torchao casts."""
    bf16: Estimate | None
    seconds: float


def evaluate_fp8(run: Run, directory: Path, *, with_bf16: bool = True, async_tp: bool = False) -> Fp8Outcome:
    started = time.perf_counter()
    handling = handling_of(run)
    planner = fp8_planner(run, directory, handling, async_tp)
    estimate, _ = planner.evaluate(run.config(planner))
    runtime = {handling: estimate}
    for name in ("compiled", "eager"):
        if name not in runtime:
            other = fp8_planner(run, directory, name)
            runtime[name] = other.evaluate(run.config(other))[0]
    bf16 = evaluate_run(run, directory).estimate if with_bf16 else None
    predicted = run.predicted(estimate.step_time_s)
    return Fp8Outcome(run=run, handling=handling, estimate=estimate, predicted=predicted,
                      error=predicted / run.published - 1, compiled=runtime["compiled"], eager=runtime["eager"],
                      bf16=bf16, seconds=time.perf_counter() - started)


def _row(outcome: Fp8Outcome) -> str:
    run, estimate = outcome.run, outcome.estimate
    gib = 2**30
    runtime = [run.predicted(priced.step_time_s) for priced in (outcome.compiled, outcome.eager)]
    bf16 = f"{run.predicted(outcome.bf16.step_time_s):.4g}" if outcome.bf16 else "-"
    gain = f"{outcome.bf16.step_time_s / estimate.step_time_s:.2f}x" if outcome.bf16 else "-"
    measured = f"{run.measured_memory_bytes / gib:.1f}" if run.measured_memory_bytes else "-"
    memory_error = (f"{100 * (estimate.peak_memory_bytes / run.measured_memory_bytes - 1):+.0f}%"
                    if run.measured_memory_bytes else "-")
    return (f"| {run.id} | {recipe_of(run)}, {outcome.handling} | {run.published:g} | {outcome.predicted:.4g} | "
            f"{100 * outcome.error:+.1f}% | "
            + "".join(f"{value:.4g} ({100 * (value / run.published - 1):+.1f}%) | " for value in runtime) +
            f"{bf16} | {gain} | "
            f"{estimate.peak_memory_bytes / gib:.1f} | {measured} | {memory_error} | "
            f"{'yes' if estimate.fits else 'NO'} | {outcome.seconds:.1f} |")


def _print_breakdown(outcome: Fp8Outcome) -> None:
    for name, estimate in (("as run", outcome.estimate), ("compiled", outcome.compiled), ("eager", outcome.eager)):
        parts = ", ".join(f"{term} {seconds:.3g}" for term, seconds in estimate.breakdown_s.items() if seconds)
        print(f"|   | {name}: step {estimate.step_time_s:.4g} s: {parts} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--breakdown", action="store_true", help="also print each row's time breakdown")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 pricing of each configuration")
    parser.add_argument("--async-tp", action="store_true",
                        help="price the rows that ran torch's async TP with it (default: their TP collectives exposed)")
    args = parser.parse_args()
    runs = read_fp8_runs()
    runs = select_rows(runs, args.rows)
    print("| run | recipe, casts | published | predicted | error | autopar compiled casts (error) | "
          "autopar eager casts (error) | bf16 predicted | fp8 gain (modelled) | predicted peak GiB | measured GiB | "
          "memory error | fits | time (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    outcomes = []
    with tempfile.TemporaryDirectory() as directory:
        for run in runs:
            outcome = evaluate_fp8(run, Path(directory), with_bf16=not args.no_bf16, async_tp=args.async_tp)
            outcomes.append(outcome)
            print(_row(outcome), flush=True)
            if args.breakdown:
                _print_breakdown(outcome)
    errors = [abs(outcome.error) for outcome in outcomes]
    if errors:
        print(f"\nmedian absolute error {100 * statistics.median(errors):.1f}%, largest {100 * max(errors):.1f}%, "
              f"{sum(error <= 0.10 for error in errors)}/{len(errors)} within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

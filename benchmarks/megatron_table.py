"""Megatron-LM SC21 Table 1: published configurations vs autopar's prediction and its own plan.

    .venv/bin/python benchmarks/megatron_table.py [--rows 1,2,3] [--no-search]

For each row: the model (GPT, seq 2048, vocab 51200) on dgx-a100-80g nodes (GPUs / 8), the
global batch; `evaluate` prices Megatron's configuration (tp, pp, microbatch size, full
recomputation, interleaving; tensor parallelism without sequence parallelism, which SC21 predates;
the "with SP" column prices it with sequence parallelism allowed, for comparison) and `plan`
searches (sequence parallelism allowed); throughput per GPU uses the table's FLOP
formula F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) / step time / GPUs.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from autopar import api
from autopar.solver.constraints import Constraints
from autopar.solver.search import Planner, SearchOptions
from cost_model.memory import MEGATRON_BF16

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "megatron_table1.csv"
SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Row:
    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    microbatch_size: int
    interleave: int | None
    tflops_per_gpu: float

    @property
    def model(self) -> str:
        return f"gpt:layers={self.layers},hidden={self.hidden},heads={self.heads},seq={SEQ},vocab={VOCAB}"

    @property
    def cluster(self) -> str:
        return f"dgx-a100-80g:nodes={self.gpus // 8}"

    def flops_per_step(self) -> float:
        b, s, l, h, v = self.global_batch, SEQ, self.layers, self.hidden, VOCAB
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def tflops(self, step_time_s: float) -> float:
        return self.flops_per_step() / step_time_s / self.gpus / 1e12


def read_rows(path: Path = REFERENCE) -> list[Row]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    rows = []
    for item in csv.DictReader(lines):
        rows.append(Row(float(item["params_billion"]), int(item["heads"]), int(item["hidden"]), int(item["layers"]),
                        int(item["tp"]), int(item["pp"]), int(item["gpus"]), int(item["global_batch"]),
                        int(item["microbatch_size"]), int(item["interleave"]) if item["interleave"] else None,
                        float(item["tflops_per_gpu"])))
    return rows


def planner_for(row: Row):
    # Megatron-LM steps with Apex's fused Adam; autopar's own plans are priced with AdamW(fused=True)
    # too, so that the two columns differ in the parallelization, not in the optimizer kernel.
    return api.planner_for(row.model, None, row.cluster, global_batch=row.global_batch,
                           options=SearchOptions(optimizer="fused"))


def evaluate_published(planner, row: Row, *, sequence_parallel: bool = False):
    """Megatron's configuration as Megatron-LM ran it: bf16 parameters used directly (no cast per
    use, which autopar's own runtime, the `plan` column, pays), tensor parallelism without
    sequence parallelism (SC21 predates it: Korthikanti et al. 2022), and its pipeline split:
    num_layers / (pp x vp) layers per model chunk, the embedding on the first, the output layer and
    loss on the last ("uniform"; Megatron-LM of 2021 asserts that the layers divide)."""
    planner = Planner(planner.graph, planner.cluster, global_batch=row.global_batch, policy=MEGATRON_BF16)
    config = api.fixed_config(planner, tp=row.tp, pp=row.pp, dp=None, microbatch_size=row.microbatch_size,
                              schedule="interleaved" if row.interleave else "1f1b", virtual_stages=None,
                              layers_per_virtual_stage=row.interleave, recompute="full", zero_stage=0,
                              sequence_parallel=sequence_parallel, pipeline_split="uniform")
    estimate, _ = planner.evaluate(config)
    return estimate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="1-based row numbers, e.g. 1,2")
    parser.add_argument("--no-search", action="store_true", help="only evaluate the published configurations")
    args = parser.parse_args()
    rows = read_rows()
    if args.rows:
        rows = [rows[int(i) - 1] for i in args.rows.split(",")]
    print("| model | GPUs | published tp/pp/b | published TF/s | predicted TF/s | error | with SP: TF/s | error | "
          "autopar plan | autopar TF/s | plan time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        started = time.perf_counter()
        planner = planner_for(row)
        published = evaluate_published(planner, row)
        predicted = row.tflops(published.step_time_s)
        error = 100 * (predicted / row.tflops_per_gpu - 1)
        with_sp = row.tflops(evaluate_published(planner, row, sequence_parallel=True).step_time_s)
        found, found_tflops = "-", float("nan")
        if not args.no_search:
            best = planner.search(Constraints()).best
            found, found_tflops = best.config.describe(), row.tflops(best.step_time_s)
        print(f"| {row.params_billion}B | {row.gpus} | {row.tp}/{row.pp}/{row.microbatch_size}"
              f"{'/v' + str(row.interleave) if row.interleave else ''} | {row.tflops_per_gpu:.0f} | {predicted:.0f} | "
              f"{error:+.1f}% | {with_sp:.0f} | {100 * (with_sp / row.tflops_per_gpu - 1):+.1f}% | {found} | "
              f"{found_tflops:.0f} | {time.perf_counter() - started:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far the timeline (each schedule run pass by pass with the step model's per-chunk times)
is from the step model's closed-form step time, for GPT-3 175B on 1,024 A100s.

    .venv/bin/python benchmarks/timeline_vs_step_model.py

One capture and one intra-op solve per (tp, microbatch); each configuration is priced with
`api.evaluate_with` (its recomputation on every stage) and laid out with
`autopar.report.timeline.layout`.
"""

from __future__ import annotations

import time

from autopar import api
from autopar.report.timeline import layout

CONFIGS = (
    dict(tp=8, pp=8, schedule="1f1b", recompute="selective", zero_stage=1),
    dict(tp=8, pp=8, schedule="gpipe", recompute="full", zero_stage=1),
    dict(tp=8, pp=8, schedule="interleaved", virtual_stages=2, recompute="selective", zero_stage=1),
    dict(tp=4, pp=16, schedule="interleaved", virtual_stages=3, recompute="selective", zero_stage=1),
    dict(tp=4, pp=16, schedule="interleaved", virtual_stages=6, recompute="selective", zero_stage=1),
    dict(tp=8, pp=8, schedule="zb1p", recompute="selective", zero_stage=1),
    dict(tp=4, pp=16, schedule="zb1p", virtual_stages=3, recompute="selective", zero_stage=1),
    dict(tp=8, pp=8, schedule="zbv", recompute="selective", zero_stage=1),
)


def main() -> None:
    planner = api.planner_for("gpt3-175b", None, "dgx-a100-80g:nodes=128", global_batch=1536)
    print("| configuration | predicted (s) | drawn (s) | drawn - predicted | layout time (s) |")
    print("|---|---|---|---|---|")
    for settings in CONFIGS:
        config = api.fixed_config(planner, dp=None, microbatch_size=1, layers_per_virtual_stage=None,
                                  **{"virtual_stages": None, **settings})
        plan = api.evaluate_with(planner, config)
        started = time.perf_counter()
        timeline = layout(plan)
        elapsed = time.perf_counter() - started
        print(f"| {config.describe()} | {plan.predicted.step_time_s:.4g} | {timeline.end_s:.4g} | "
              f"{100 * timeline.mismatch:+.2f}% | {elapsed:.2f} |")


if __name__ == "__main__":
    main()

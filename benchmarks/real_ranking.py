"""Predicted against measured whole steps, and autopar's pick with and without trials (issue 10).

    .venv/bin/autopar profile --nproc 4 --quick --out /tmp/p.json     # measures, then calibrates (the default)
    .venv/bin/python benchmarks/real_ranking.py --profile /tmp/p.json --procs 4 [--model gpt|llama] [--markdown]
    # two calibrations judged on the same steps: another profile, or the same measurements
    # refitted on the first calibration model only (e.g. a profile calibrated on two sizes):
    .venv/bin/python benchmarks/real_ranking.py --profile /tmp/p.json --other-profile /tmp/p1.json --procs 4
    .venv/bin/python benchmarks/real_ranking.py --profile /tmp/p.json --one-size --procs 4
    # 2 processes too (the default --procs 4 2): add their calibration to the same profile
    .venv/bin/autopar profile --nproc 2 --out /tmp/p.json --calibrate gpt:layers=4,hidden=128,heads=4,seq=128,vocab=512,dropout=0.0

For 4 and then 2 gloo processes of this machine (one job each), a model of MODELS at global batch
16, fp32, SGD: each configuration of the table (fixed mesh and ZeRO stage; microbatching left to
the planner) is planned on `cpu:procs=N,profile=...`, priced with the profile's calibration and
without it. First `trials=4` runs as `parallelize(..., trials=4)` runs it (the four best predicted
candidates one after another, with early stopping; its wall time includes building every candidate)
and picks its winner. Then every configuration (the table's, autopar's pick without trials,
calibrated and uncalibrated, the trials' winner and every other trial candidate) runs
`warmup + steps` steps (train_step + optimizer.step(), slowest rank, median after warm-up:
autopar.tune.trials), all built first and run in interleaved rounds, so that load from other jobs
falls on each alike: each pick is judged against the best configuration measured in the same rounds
(the trials' own sequential medians, taken minutes apart, are listed but not compared). Rows that
are the same configuration (a pick is often one of the table's) are one measurement: each shows the
median of all their steps. The default calibration ran on another model (the built-in GPT of
hidden 320, autopar.tune.defaults.DEFAULT_CALIBRATION_MODELS) and its own fixed set of
configurations, so every row here is held out. Prints per N: the table, the rank correlation (Spearman) of predicted and measured
over the table's configurations, the median |predicted / measured - 1|, and the measured time
of each pick over the best measured configuration.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import statistics
import time

MODELS = {"gpt": "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=512,dropout=0.0",
          "llama": "llama:layers=8,hidden=256,heads=8,kv_heads=4,seq=128,vocab=512"}
"""The models ranked (`--model`): a 4-layer GPT and an 8-layer Llama with grouped-query attention."""
GLOBAL_BATCH = 16
TABLE = {
    4: [("dp=4", dict(dp=4, tp=1, pp=1, zero_stage=0)),
        ("dp=4 ZeRO-3", dict(dp=4, tp=1, pp=1, zero_stage=3)),
        ("dp=2 tp=2", dict(dp=2, tp=2, pp=1, zero_stage=0)),
        ("tp=4", dict(dp=1, tp=4, pp=1)),
        ("dp=2 pp=2 1F1B", dict(dp=2, tp=1, pp=2, zero_stage=0, schedule="1f1b")),
        ("pp=4 1F1B", dict(dp=1, tp=1, pp=4, schedule="1f1b")),
        ("tp=2 pp=2 1F1B", dict(dp=1, tp=2, pp=2, schedule="1f1b"))],
    2: [("dp=2", dict(dp=2, tp=1, pp=1, zero_stage=0)),
        ("tp=2", dict(dp=1, tp=2, pp=1)),
        ("pp=2 1F1B", dict(dp=1, tp=1, pp=2, schedule="1f1b"))],
}
NUM_TRIALS = 4
TRIALS_PICK = f"autopar's pick with trials={NUM_TRIALS}"


def worker(num_processes: int, profile: str, steps: int, warmup: int, model: str = MODELS["gpt"],
           other_profile: str | None = None) -> dict:
    """Every rank: plan (rank 0), run every configuration, the picks and the trials. With
    `other_profile` (another calibration of this machine) every configuration is priced with it too
    and its own pick runs beside the others: two calibrations judged on one set of steps."""
    from dataclasses import replace

    from autopar import api
    from autopar.codegen.runtime import run_on_rank0
    from autopar.models import build_model
    from autopar.solver.constraints import Constraints
    from autopar.solver.search import Planner
    from autopar.tune.trials import TrialOptions, run_trials, select_winner

    bundle = build_model(model, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    cluster = f"cpu:procs={num_processes},profile={profile}"

    def plan_all():
        calibrated = api.planner_for(bundle.model, bundle.example_inputs, cluster, global_batch=GLOBAL_BATCH,
                                     loss_fn=bundle.loss_fn, example_targets=bundle.example_targets, precision="fp32")
        if calibrated.overheads is None:
            raise SystemExit(f"{profile} has no calibration for {num_processes} processes: run "
                             f"`autopar profile --nproc {num_processes} --out {profile}`")
        raw = Planner(calibrated.graph, calibrated.cluster, global_batch=GLOBAL_BATCH, policy=calibrated.policy,
                      precision="fp32")
        rows = []
        for label, constraints in TABLE[num_processes]:
            plan = api.plan_with(calibrated, Constraints(**constraints))
            rows.append((label, plan, _raw_prediction(raw, plan)))
        pick = api.plan_with(calibrated)
        raw_pick = api.plan_with(raw)
        rows.append(("autopar's pick, calibrated, no trials", pick, _raw_prediction(raw, pick)))
        rows.append(("autopar's pick, uncalibrated, no trials", raw_pick, raw_pick.predicted.step_time_s))
        candidates = api.candidates_with(calibrated, num_candidates=NUM_TRIALS)
        candidate_raw_s = [_raw_prediction(raw, plan) for plan in candidates]
        if other_profile:
            other = api.planner_for(bundle.model, bundle.example_inputs,
                                    f"cpu:procs={num_processes},profile={other_profile}", global_batch=GLOBAL_BATCH,
                                    loss_fn=bundle.loss_fn, example_targets=bundle.example_targets, precision="fp32")
            other_pick = api.plan_with(other)
            rows.append(("autopar's pick, other calibration, no trials", other_pick, _raw_prediction(raw, other_pick)))
            rows = [(label, plan, raw_s, _raw_prediction(other, plan)) for label, plan, raw_s in rows]
            candidates = [(plan, raw_s, _raw_prediction(other, plan)) for plan, raw_s in zip(candidates, candidate_raw_s)]
        else:
            rows = [(label, plan, raw_s, None) for label, plan, raw_s in rows]
            candidates = [(plan, raw_s, None) for plan, raw_s in zip(candidates, candidate_raw_s)]
        return rows, candidates

    rows, candidates = run_on_rank0(plan_all)
    measure = TrialOptions(warmup_steps=warmup, steps=steps, interleave=True)
    started = time.perf_counter()
    trial_results = run_trials(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn,
                               [plan for plan, _, _ in candidates], options=replace(measure, interleave=False),
                               progress=_say)
    trials_wall_s = time.perf_counter() - started
    winner = select_winner(trial_results)
    rows = rows + _trial_rows(rows, candidates, winner)
    results = run_trials(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn,
                         [plan for _, plan, _, _ in rows], options=measure, progress=_say)
    return dict(
        rows=[dict(label=label, config=result.config, raw_s=raw_s, predicted_s=plan.predicted.step_time_s,
                   other_s=other_s, measured_s=result.measured_s, failure=result.error, step_times_s=result.step_times_s,
                   expected_error=plan.predicted.expected_error)
              for (label, plan, raw_s, other_s), result in zip(rows, results)],
        trials=[dict(config=r.config, predicted_s=r.predicted_s, measured_s=r.measured_s, stopped=r.stopped_early,
                     setup_s=r.setup_s, steps=len(r.step_times_s)) for r in trial_results],
        trials_wall_s=trials_wall_s)


def _trial_rows(rows: list, candidates: list, winner: int) -> list:
    """Rows measuring the trials' winner and every other candidate not already a row, so that all
    run in the same interleaved rounds as the table."""
    from autopar.tune.trials import describe

    plan, raw_s, other_s = candidates[winner]
    added = [(TRIALS_PICK, plan, raw_s, other_s)]
    seen = {describe(row[1]) for row in rows} | {describe(plan)}
    for index, (plan, raw_s, other_s) in enumerate(candidates):
        if describe(plan) not in seen:
            seen.add(describe(plan))
            added.append((f"autopar's trial candidate {index + 1}", plan, raw_s, other_s))
    return added


def _raw_prediction(raw, plan) -> float:
    from autopar.solver.step_model import ParallelConfig

    config = ParallelConfig(dp=plan.mesh["dp"], tp=plan.mesh["tp"], pp=plan.mesh["pp"],
                            microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                            schedule=plan.schedule if plan.mesh["pp"] > 1 else "1f1b",
                            virtual_stages=plan.virtual_stages, recompute=plan.recompute, zero_stage=plan.zero_stage)
    estimate, _ = raw.evaluate(config)
    return estimate.step_time_s


def _say(message: str) -> None:
    import sys

    print(f"  {message}", file=sys.stderr, flush=True)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    mean_x, mean_y = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mean_x) * (b - mean_y) for a, b in zip(rx, ry))
    norm = (sum((a - mean_x) ** 2 for a in rx) * sum((b - mean_y) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else 0.0


def _pooled(rows: list[dict]) -> list[dict]:
    """Rows whose measured time is the median of every step its configuration ran in the rounds:
    a pick that is one of the table's configurations ran as two rows, and is one configuration."""
    steps: dict[str, list[float]] = {}
    for row in rows:
        if row["measured_s"]:
            steps.setdefault(row["config"], []).extend(row["step_times_s"])
    return [dict(row, measured_s=statistics.median(steps[row["config"]])) if row["measured_s"] else row
            for row in rows]


def report(num_processes: int, outcome: dict, markdown: bool, exit_codes: list[int]) -> str:
    rows, trials = _pooled(outcome["rows"]), outcome["trials"]
    table_rows = [row for row in rows if not row["label"].startswith("autopar")]
    measured = [row for row in table_rows if row["measured_s"]]
    best = min(row["measured_s"] for row in rows if row["measured_s"])
    lines = [f"### {num_processes} processes", "",
             "| configuration | plan | uncalibrated ms | calibrated ms | measured ms | error (calibrated) |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        shown = f"{row['measured_s'] * 1e3:.0f}" if row["measured_s"] else f"failed: {row['failure']}"
        error = f"{100 * (row['predicted_s'] / row['measured_s'] - 1):+.0f}%" if row["measured_s"] else ""
        lines.append(f"| {row['label']} | {row['config']} | {row['raw_s'] * 1e3:.0f} | {row['predicted_s'] * 1e3:.0f} | "
                     f"{shown} | {error} |")
    lines.append("")
    lines.append("trials (their own sequential medians): " + "; ".join(
        f"{t['config']} predicted {t['predicted_s'] * 1e3:.0f} ms, measured "
        + (f"{t['measured_s'] * 1e3:.0f} ms" if t["measured_s"] else "failed")
        + (" (stopped early)" if t["stopped"] else "") + f" in {t['steps']} steps, set-up {t['setup_s']:.0f} s"
        for t in trials) + f"; wall time of the trials {outcome['trials_wall_s']:.0f} s")
    lines.append("")
    kinds = [("calibrated", "predicted_s"), ("uncalibrated", "raw_s")]
    if rows[0]["other_s"] is not None:
        kinds.append(("other calibration", "other_s"))
    for kind, key in kinds:
        errors = [abs(row[key] / row["measured_s"] - 1) for row in measured]
        rho = spearman([row[key] for row in measured], [row["measured_s"] for row in measured])
        lines.append(f"- {kind}: median |error| {100 * statistics.median(errors):.0f}%, rank correlation {rho:.2f} "
                     f"over {len(measured)} configurations")
    for row in rows:
        if row["label"].startswith("autopar's pick") and row["measured_s"]:
            lines.append(f"- {row['label']}: {row['measured_s'] / best:.2f} x the best measured")
    lines.append(f"- best measured: {best * 1e3:.0f} ms ({min(rows, key=lambda row: row['measured_s'] or 1e9)['label']})")
    if any(code != 0 for code in exit_codes):
        lines.append(f"- the job's processes exited with codes {exit_codes} after the results were saved")
    return "\n".join(lines)


def one_size_profile(path: str) -> str:
    """A copy of the profile whose calibrations are fitted on their first model's points alone
    (written beside it as NAME.one-size.json)."""
    from dataclasses import replace

    from autopar.tune.calibrate import MODEL_SEPARATOR, refit
    from cost_model.profile import load_profile

    profile = load_profile(path)
    calibrations = []
    for calibration in profile.calibrations:
        first = calibration.model.split(MODEL_SEPARATOR)[0]
        points = tuple(point for point in calibration.points if point.model in (first, ""))
        calibrations.append(refit(replace(calibration, model=first, points=points)))
    out = str(Path(path).with_suffix(".one-size.json"))
    replace(profile, calibrations=tuple(calibrations)).save(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a profile calibrated for 2 and 4 processes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--procs", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt", help="which model to rank (default gpt)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--other-profile", metavar="P2",
                        help="another calibrated profile of this machine: the same steps judged with its prices too")
    parser.add_argument("--one-size", action="store_true",
                        help="the other profile: --profile's calibrations refitted on their first model's points only")
    args = parser.parse_args()
    if args.one_size:
        args.other_profile = one_size_profile(args.profile)
    from autopar.tune.launch import spawn

    started = time.perf_counter()
    load = os.getloadavg()[0]
    for num_processes in args.procs:
        outcome = spawn(worker, num_processes=num_processes,
                        args=(num_processes, os.path.abspath(args.profile), args.steps, args.warmup,
                              MODELS[args.model], args.other_profile and os.path.abspath(args.other_profile)))
        print(report(num_processes, outcome.value, args.markdown, outcome.exit_codes), flush=True)
        print(flush=True)
    print(f"model {MODELS[args.model]}; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()

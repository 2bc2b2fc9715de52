"""The report commands of the `autopar` CLI (cli.py adds them): `show --timeline/--memory/--html`,
`explain`, `diff` and `compare`. Thin: each parses its flags and calls the report modules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar.errors import ConfigError
from autopar.plans.plan import Plan

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def add_show_options(show: argparse.ArgumentParser) -> None:
    show.add_argument("--timeline", metavar="FILE", help="draw one step per pipeline rank (.png, .svg, .pdf or .html)")
    show.add_argument("--memory", metavar="FILE", help="draw memory per pipeline stage (.png, .svg or .pdf)")
    show.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")


def add_parsers(commands) -> None:
    explain = commands.add_parser("explain", help="why this plan and not the runners-up")
    explain.add_argument("plan_file", metavar="PLAN.json")
    explain.add_argument("--alternatives", type=int, default=3, metavar="N", help="runners-up to compare (default 3)")
    explain.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    explain.set_defaults(handler=_explain)
    diff = commands.add_parser("diff", help="what two saved plans choose differently")
    diff.add_argument("plan_a", metavar="A.json")
    diff.add_argument("plan_b", metavar="B.json")
    diff.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    diff.set_defaults(handler=_diff)
    compare = commands.add_parser("compare", help="plan a model on several clusters: fastest and cheapest")
    compare.add_argument("model", metavar="MODEL", help="as for `autopar plan`")
    compare.add_argument("--global-batch", type=int, required=True, metavar="B", help="samples per optimizer step")
    compare.add_argument("--clusters", nargs="+", required=True, metavar="SPEC", help="cluster specs or TOML files")
    compare.add_argument("--price-per-gpu-hour", nargs="+", type=float, metavar="P",
                         help="price of one device for one hour, one per cluster (default: each TOML's "
                              "price_per_gpu_hour)")
    compare.add_argument("--tokens", type=float, metavar="N",
                         help="tokens to train on (samples for models without token ids): time and cost of it")
    compare.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    compare.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    compare.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    compare.set_defaults(handler=_compare)


def write_pictures(plan: Plan, *, timeline: str | None = None, memory: str | None = None,
                   html_path: str | None = None) -> list[str]:
    """Writes what was asked for; returns one line per file written."""
    from autopar.report import draw, html
    from autopar.report.timeline import layout

    timeline_suffix = _suffix(timeline, FIGURE_SUFFIXES + (".html",), "--timeline") if timeline else ""
    if memory:
        _suffix(memory, FIGURE_SUFFIXES, "--memory")
    written = []
    if timeline:
        drawn = layout(plan)
        if timeline_suffix == ".html":
            _write(timeline, html.timeline_html(plan))
        else:
            _save(draw.timeline_figure(plan, drawn), timeline)
        written.append(f"wrote {timeline}: timeline of one step, {drawn.end_s:.4g} s as drawn, "
                       f"{plan.predicted.step_time_s:.4g} s predicted ({100 * drawn.mismatch:+.2f}%)")
    if memory:
        _save(draw.memory_figure(plan), memory)
        written.append(f"wrote {memory}: memory per device of {len(plan.stages)} pipeline stage(s)")
    if html_path:
        _write(html_path, html.report_html(plan))
        written.append(f"wrote {html_path}: HTML report (self-contained)")
    return written


def _suffix(path: str, allowed: tuple[str, ...], flag: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in allowed:
        raise ConfigError(f"{flag} {path}: unknown picture format '{suffix or '(none)'}'; name the file "
                          f"{' or '.join('*' + s for s in allowed)}")
    return suffix


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as error:
        raise ConfigError(f"cannot write '{path}': {error.strerror or error}") from None


def _save(figure, path: str) -> None:
    from autopar.report.draw import save_figure

    try:
        save_figure(figure, path)
    except OSError as error:
        raise ConfigError(f"cannot write '{path}': {error.strerror or error}") from None


def _explain(args) -> int:
    from autopar.report.explain import explain_dict, explain_text

    plan = Plan.load(args.plan_file)
    if args.alternatives < 1:
        raise ConfigError(f"--alternatives must be at least 1, got {args.alternatives}")
    print(json.dumps(explain_dict(plan, max_alternatives=args.alternatives), indent=1) if args.json
          else explain_text(plan, max_alternatives=args.alternatives))
    return 0


def _diff(args) -> int:
    from autopar.report.diff import diff_dict, diff_text

    a, b = Plan.load(args.plan_a), Plan.load(args.plan_b)
    print(json.dumps(diff_dict(a, b), indent=1) if args.json else diff_text(a, b, names=(args.plan_a, args.plan_b)))
    return 0


def _compare(args) -> int:
    from autopar.report.compare import compare_clusters, comparison_dict, comparison_text

    comparison = compare_clusters(args.model, global_batch=args.global_batch, clusters=args.clusters,
                                  prices=args.price_per_gpu_hour, amount=args.tokens, precision=args.precision,
                                  verbose=args.verbose)
    print(json.dumps(comparison_dict(comparison), indent=1) if args.json else comparison_text(comparison))
    return 0

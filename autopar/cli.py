"""The `autopar` command: a thin layer over the API.

    autopar plan MODEL --cluster SPEC --global-batch B [--dp D] [--tp T] [--pp P] [--cp C] [--jobs N] [--json]
    autopar evaluate MODEL --cluster SPEC --global-batch B --tp T --pp P --microbatch-size b ...
    autopar profile [--device cpu|cuda] [--nproc N] [--out profile.json] [--no-calibrate]
        (N >= 2 on the CPU: also fits whole-step terms on a small built-in model; --calibrate MODEL for
        another, repeatable for one fit over several)
    torchrun --nproc-per-node N -m autopar.cli tune MODEL --cluster SPEC --global-batch B --trials k
    autopar show PLAN.json [--timeline out.png|out.html] [--memory out.png] [--html report.html]
    autopar explain PLAN.json
    autopar diff A.json B.json
    autopar compare MODEL --global-batch B --clusters SPEC1 SPEC2 ... [--price-per-gpu-hour P1 P2 ...]
    autopar graph MODEL            (plan, evaluate, graph: --no-capture-cache traces again)
    autopar verify MODEL [--nproc 2|4] [--steps S] [--kinds dp,tp,pp,...] [--json]
        (exit 1 when a kind's losses differ from one process's or a kind fails)
    autopar models

Errors in the input (model, cluster, constraints, plan or profile files, infeasible models)
print one paragraph and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from autopar.capture.heap import collector_paused, freeze_at_exit
from autopar.tune.defaults import DEFAULT_CALIBRATION_MODELS

with collector_paused():  # torch and the planner: 0.25 CPU s of the collector's passes, nothing to free
    from autopar.plans import planning
    from autopar.report import commands as report_commands
    from autopar.errors import AutoparError, ConfigError
    from autopar.solver.experts import check_load_imbalance
    from autopar.solver.recompute import RECOMPUTE_MODES
    from autopar.solver.search import SearchOptions
    from autopar.validation import MAX_DEVICES, MAX_DEVICES_PER_NODE, MAX_GLOBAL_BATCH, check_output_path, parse_int

EXIT_INPUT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse has printed its usage error (exit 2) or the help (exit 0)
        return stop.code if isinstance(stop.code, int) else EXIT_INPUT_ERROR
    try:
        with _capture_cache_switch(getattr(args, "no_capture_cache", False)):
            return args.handler(args)
    except AutoparError as error:
        print(f"autopar: error: {error}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _capture_cache_switch(off: bool):
    """--no-capture-cache: the capture cache's switch-off for this command (restored after it)."""
    from autopar.capture import cache as capture_cache

    previous = os.environ.get(capture_cache.SWITCH_ENV)
    if off:
        os.environ[capture_cache.SWITCH_ENV] = "0"
    try:
        yield
    finally:
        if off and previous is None:
            os.environ.pop(capture_cache.SWITCH_ENV, None)
        elif off:
            os.environ[capture_cache.SWITCH_ENV] = previous


def count(maximum: int = MAX_DEVICES):
    """argparse type: an integer in [1, maximum]; 0 is refused, not read as "not set"."""
    def parse(text: str) -> int:
        try:
            return parse_int(text, "value", maximum=maximum, error=AutoparError)
        except AutoparError as error:
            raise argparse.ArgumentTypeError(str(error).replace("value ", "", 1)) from None
    parse.__name__ = "count"  # argparse names the type in some messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan and apply parallelism for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _plan_parser(commands)
    _evaluate_parser(commands)
    _profile_parser(commands)
    _tune_parser(commands)
    show = commands.add_parser("show", help="print the report of a saved plan")
    show.add_argument("plan_file", metavar="PLAN.json")
    show.add_argument("--json", action="store_true", help="print the plan as JSON")
    report_commands.add_show_options(show)
    show.set_defaults(handler=_show)
    report_commands.add_parsers(commands)
    graph = commands.add_parser("graph", help="capture a model and summarise its op graph")
    graph.add_argument("model", metavar="MODEL")
    _cache_flag(graph)
    graph.set_defaults(handler=_graph)
    _verify_parser(commands)
    models = commands.add_parser("models", help="list the built-in models and named sizes")
    models.set_defaults(handler=_models)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="registry name with overrides (gpt:layers=96,hidden=12288,heads=96) or file.py:factory")
    parser.add_argument("--cluster", required=True, metavar="SPEC",
                        help="e.g. dgx-a100-80g:nodes=16, dgx-h100:nodes=2,gpus_per_node=4, cpu:procs=4, or a TOML file")
    parser.add_argument("--global-batch", type=count(MAX_GLOBAL_BATCH), required=True, metavar="B",
                        help="samples per optimizer step")
    parser.add_argument("--precision", choices=sorted(planning.PRECISIONS), default="bf16",
                        help="bf16 (default), fp32, or fp8: bf16 with the linears in float8 through torchao "
                             "(GPUs with FP8 tensor cores, H100/H200/B200; emulated on CPU clusters)")
    parser.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach",
                        help="how the training script's AdamW runs, for the optimizer step's price: foreach "
                             "(torch.optim.AdamW's default, the default here) or fused (AdamW(fused=True), Apex)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--out", metavar="FILE", help="also save the plan as JSON")
    parser.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    _cache_flag(parser)


def _fp8_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"],
                        help="with --precision fp8: torchao's scaling, one scale per tensor (default; FSDP "
                             "gathers weights in float8) or one per row")
    parser.add_argument("--fp8-casts", choices=["compiled", "eager"],
                        help="with --precision fp8: how the runtime runs (and the plan prices) the float8 casts: "
                             "compiled by torch.compile (default on GPU clusters) or torchao op by op (eager; "
                             "default on CPU clusters)")


def _tp_overlap_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp-overlap", choices=list(planning.TP_OVERLAPS),
                        help="how the runtime runs (and the plan prices) sequence parallelism's all-gathers and "
                             "reduce-scatters: async (fused with the GEMMs they feed, torch's async TP; default on "
                             "CUDA clusters, needs sequence parallelism) or off (DTensor's collectives, exposed)")


def _cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-capture-cache", action="store_true",
                        help="trace the model even if the capture cache holds it (as AUTOPAR_CAPTURE_CACHE=0)")


def _plan_parser(commands) -> None:
    parser = commands.add_parser("plan", help="search the fastest parallelization that fits")
    _common(parser)
    parser.add_argument("--dp", type=count(), help="fix the data-parallel degree")
    parser.add_argument("--tp", type=count(), help="fix the tensor-parallel degree")
    parser.add_argument("--pp", type=count(), help="fix the pipeline-parallel degree")
    parser.add_argument("--cp", type=count(), help="fix the context-parallel degree (each sequence split over CP ranks)")
    parser.add_argument("--microbatch-size", type=count(MAX_GLOBAL_BATCH))
    parser.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "zb1p", "zbv"])
    parser.add_argument("--layers-per-virtual-stage", type=count())
    _pipeline_split_flag(parser, default=None)
    parser.add_argument("--recompute", choices=list(RECOMPUTE_MODES))
    _recompute_modules_flag(parser)
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--ep", type=count(), help="fix the expert-parallel degree (divides dp; MoE models)")
    parser.add_argument("--etp", type=count(), help="fix the expert tensor-parallel degree: 1 (MoE parallel folding "
                        "with tp > 1: experts unsplit by tp, the ep group over tp x dp; searched with cp=1 and without "
                        "--recompute-modules, where the runtime runs it; or tp=1) or k > 1 (pins tp=k)")
    _load_imbalance_flag(parser)
    parser.add_argument("--offload", choices=["auto", "on", "off"], default="auto",
                        help="optimizer offload (FSDP2 CPUOffloadPolicy): auto uses it only when nothing fits without")
    _sequence_parallel_flag(parser)
    _fp8_flag(parser)
    _tp_overlap_flag(parser)
    parser.add_argument("--jobs", type=count(1024), metavar="N",
                        help="processes that price configurations (default: $AUTOPAR_JOBS, else the usable cores up "
                             "to 8; 1 for a small search)")
    parser.set_defaults(handler=_plan)


def _evaluate_parser(commands) -> None:
    parser = commands.add_parser("evaluate", help="price one fixed configuration")
    _common(parser)
    parser.add_argument("--tp", type=count(), required=True)
    parser.add_argument("--pp", type=count(), required=True)
    parser.add_argument("--dp", type=count(), help="default: devices / (tp x pp x cp)")
    _fp8_flag(parser)
    _tp_overlap_flag(parser)
    parser.add_argument("--cp", type=count(), default=1, help="context-parallel degree (default 1)")
    parser.add_argument("--microbatch-size", type=count(MAX_GLOBAL_BATCH), required=True)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "zb1p", "zbv"], default="1f1b")
    parser.add_argument("--layers-per-virtual-stage", type=count())
    _pipeline_split_flag(parser, default="balanced")
    parser.add_argument("--recompute", choices=list(RECOMPUTE_MODES), default=None)
    _recompute_modules_flag(parser)
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    parser.add_argument("--ep", type=count(), default=1, help="expert-parallel degree (divides dp; MoE models)")
    parser.add_argument("--etp", type=count(), help="expert tensor-parallel degree: tp (default: experts on the tp "
                        "solve, ep over dp ranks) or 1 with tp > 1 (MoE parallel folding: experts unsplit by tp, "
                        "the ep group over tp x dp; ep must divide tp x dp; run with cp=1, not with --recompute-modules)")
    _load_imbalance_flag(parser)
    parser.add_argument("--offload", action="store_true", help="optimizer offload (needs --zero 3 and --pp 1)")
    _sequence_parallel_flag(parser)
    parser.set_defaults(handler=_evaluate)


def _load_imbalance_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe-load-imbalance", type=load_imbalance, metavar="X",
                        help="MoE models: tokens the busiest expert-parallel rank gets over the even share under "
                             "dropless routing, a number >= 1.0 (default 1.25; 1.0: force-balanced routing)")


def load_imbalance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1.0 (1.0: balanced routing), got {text!r}") from None
    try:
        return check_load_imbalance(value)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pipeline_split_flag(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    parser.add_argument("--pipeline-split", default=default, metavar="SPLIT",
                        help="how pipeline stages are cut: balanced (default: autopar's cut, the slowest stage as "
                             "fast as it can be), uniform (equal repeated blocks per model chunk, embedding on the "
                             "first, head and loss on the last, as Megatron-LM), uniform:embedding, uniform:head, "
                             "uniform:embedding,head (those counted as one block each), or first=N,last=M (blocks "
                             "of the first and last chunk, the rest even)")


def _sequence_parallel_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sequence-parallel", choices=["on", "off"], default="on",
                        help="on (default): tensor parallelism may shard norms, dropouts and residuals by sequence "
                             "where cheaper (Korthikanti et al.); off: as Megatron-LM without --sequence-parallel "
                             "(replicated on the tp ranks, partial outputs all-reduced)")


def _profile_parser(commands) -> None:
    parser = commands.add_parser("profile", help="measure this machine's devices and links for the cost model")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--nproc", type=count(MAX_DEVICES_PER_NODE), default=1,
                        help="processes for the collective sweep (default 1)")
    parser.add_argument("--out", default="profile.json", metavar="FILE")
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--calibrate", metavar="MODEL", action="append",
                        help="run a fixed set of configurations of MODEL on --nproc processes and store the fitted "
                             "whole-step terms in the profile (an existing --out file is calibrated, else measured "
                             "first); repeat it for one fit over several models; default with --nproc N >= 2 on the "
                             f"CPU: a small built-in GPT ({' and '.join(DEFAULT_CALIBRATION_MODELS)})")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="measure only: plans on this profile say they are uncalibrated")
    parser.add_argument("--global-batch", type=count(MAX_GLOBAL_BATCH), metavar="B", help="batch of the calibration runs (default 4 x nproc)")
    parser.add_argument("--cluster", metavar="SPEC",
                        help="with --calibrate under torchrun: this job's cluster, with profile=FILE (needed on GPUs, "
                             "e.g. dgx-h100:nodes=1,profile=p.json)")
    parser.set_defaults(handler=_profile)


def _tune_parser(commands) -> None:
    parser = commands.add_parser("tune", help="run the k best predicted plans for a few steps (under torchrun) and "
                                              "keep the measured fastest")
    _common(parser)
    parser.add_argument("--trials", type=count(64), default=4, metavar="K", help="candidate plans to run (default 4)")
    parser.add_argument("--steps", type=count(1000), default=5, help="timed steps per candidate (after 2 warm-up steps)")
    for axis in ("dp", "tp", "pp"):
        parser.add_argument(f"--{axis}", type=count(), help=f"fix the {axis} degree")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    _sequence_parallel_flag(parser)
    parser.set_defaults(handler=_tune)


def _verify_parser(commands) -> None:
    parser = commands.add_parser(
        "verify", help="train a tiny copy of MODEL under each plan kind on gloo processes and compare with one process",
        description="Train a tiny copy of MODEL (a built-in spec with its sizes capped at the family's tiny "
                    "defaults, or file.py:factory as the factory builds it: give a factory of a small "
                    "configuration) for a few SGD steps in fp32 under each plan kind on spawned gloo processes of "
                    "this machine, and compare the losses with one process. Exit status: 0 when every kind matches "
                    "(|loss difference| <= 1e-4) or is n/a for this model, 1 when a kind mismatches or fails, 2 "
                    "for bad input.")
    parser.add_argument("model", metavar="MODEL",
                        help="registry name with overrides (llama3-8b, gpt:attention=sdpa) or file.py:factory")
    parser.add_argument("--nproc", type=int, choices=[2, 4], default=4,
                        help="2: dp, tp, pp, cp, ep; 4 (default): also the mixes dp x tp, pp x tp, pp x dp")
    parser.add_argument("--steps", type=count(100), default=3, help="SGD steps per kind (default 3)")
    parser.add_argument("--kinds", metavar="K1,K2",
                        help="only these kinds (dp, tp, pp, cp, ep, dpxtp, ppxtp, ppxdp)")
    parser.add_argument("--json", action="store_true", help="print the cells as one JSON object")
    parser.set_defaults(handler=_verify)


def _emit(plan, args) -> int:
    if args.out is not None:
        plan.save(args.out)
    print(plan.to_json() if args.json else plan.summary())
    return 0


def _recompute_modules_flag(parser) -> None:
    parser.add_argument("--recompute-modules", metavar="KINDS",
                        help="recompute only these module kinds' ops in backward, as Megatron-Core's "
                             "--recompute-modules: a comma-separated list of layernorm, core_attn, moe_act, mlp, moe, "
                             "mla_up_proj (the recompute mode 'modules:KINDS')")
    parser.add_argument("--recompute-blocks", metavar="N", type=count(),
                        help="recompute in full only the first N repeated blocks of each model chunk and keep the "
                             "others' activations, as Megatron-Core's --recompute-granularity full --recompute-method "
                             "block --recompute-num-layers N (the recompute mode 'blocks:N')")


def _fp8_recipe(args) -> str:
    """--fp8-recipe (default tensorwise), which only --precision fp8 reads; the flags that only some
    other flag's value reads are refused in the CLI's words."""
    from autopar.errors import ConfigError

    if args.fp8_recipe is not None and args.precision != "fp8":
        raise ConfigError(f"--fp8-recipe {args.fp8_recipe} chooses the scaling of precision fp8, but the precision is "
                          f"{args.precision}: add --precision fp8 or drop --fp8-recipe")
    if args.fp8_casts is not None and args.precision != "fp8":
        raise ConfigError(f"--fp8-casts {args.fp8_casts} says how precision fp8 runs its casts, but the precision is "
                          f"{args.precision}: add --precision fp8 or drop --fp8-casts")
    if args.tp_overlap == "async" and args.sequence_parallel == "off":
        raise ConfigError("--tp-overlap async overlaps the all-gathers and reduce-scatters of sequence parallelism, "
                          "and --sequence-parallel off has none: drop --sequence-parallel off or use --tp-overlap off")
    return args.fp8_recipe or "tensorwise"


def _recompute(args) -> str | None:
    """--recompute, or the mode --recompute-modules or --recompute-blocks names (one of them;
    --recompute full may stand beside --recompute-blocks, as Megatron's granularity beside its method)."""
    from autopar.errors import ConfigError
    from autopar.solver.recompute_blocks import blocks_mode
    from autopar.solver.recompute_modules import modules_mode

    if args.recompute_modules is not None and args.recompute_blocks is not None:
        raise ConfigError(f"--recompute-modules {args.recompute_modules} and --recompute-blocks "
                          f"{args.recompute_blocks} both choose what is recomputed: give one")
    if args.recompute_blocks is not None:
        if args.recompute not in (None, "full"):
            raise ConfigError(f"--recompute-blocks {args.recompute_blocks} recomputes those blocks in full, and "
                              f"--recompute {args.recompute} asks for another mode: drop one")
        return blocks_mode(args.recompute_blocks)
    if args.recompute_modules is None:
        return args.recompute
    if args.recompute is not None:
        raise ConfigError(f"--recompute {args.recompute} and --recompute-modules {args.recompute_modules} both choose "
                          "what is recomputed: give one")
    return modules_mode(args.recompute_modules)


def _plan(args) -> int:
    if args.out is not None:  # before planning: a typo in the path should not cost the search
        check_output_path(args.out)
    constraints = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "cp": args.cp, "microbatch_size": args.microbatch_size,
                   "schedule": args.schedule, "layers_per_virtual_stage": args.layers_per_virtual_stage,
                   "recompute": _recompute(args), "zero_stage": args.zero, "ep": args.ep, "etp": args.etp,
                   "offload": {"on": True, "off": False}.get(args.offload),
                   "sequence_parallel": False if args.sequence_parallel == "off" else None,
                   "pipeline_split": args.pipeline_split}
    plan = planning.plan(args.model, cluster=args.cluster, global_batch=args.global_batch,
                    constraints={key: value for key, value in constraints.items() if value is not None},
                    precision=args.precision, verbose=args.verbose, fp8_recipe=_fp8_recipe(args),
                    fp8_casts=args.fp8_casts, tp_overlap=args.tp_overlap,
                    options=SearchOptions(jobs=args.jobs, optimizer=args.optimizer),
                    moe_load_imbalance=args.moe_load_imbalance)
    return _emit(plan, args)


def _evaluate(args) -> int:
    if args.out is not None:
        check_output_path(args.out)
    plan = planning.evaluate(args.model, cluster=args.cluster, global_batch=args.global_batch, tp=args.tp, pp=args.pp,
                        dp=args.dp, microbatch_size=args.microbatch_size, schedule=args.schedule,
                        layers_per_virtual_stage=args.layers_per_virtual_stage, recompute=_recompute(args) or "none",
                        zero_stage=args.zero, precision=args.precision, verbose=args.verbose, ep=args.ep,
                        cp=args.cp, offload=args.offload, sequence_parallel=args.sequence_parallel == "on",
                        options=SearchOptions(optimizer=args.optimizer), moe_load_imbalance=args.moe_load_imbalance,
                        fp8_recipe=_fp8_recipe(args), fp8_casts=args.fp8_casts, etp=args.etp,
                        pipeline_split=args.pipeline_split, tp_overlap=args.tp_overlap)
    return _emit(plan, args)


def _profile(args) -> int:
    from pathlib import Path

    from autopar.tune.profile import profile_machine

    check_output_path(args.out)
    if args.calibrate and args.no_calibrate:
        raise ConfigError("--calibrate MODEL and --no-calibrate contradict each other: give one")
    if args.calibrate:
        return _calibrate(args, exists=Path(args.out).exists())
    profile = profile_machine(device=args.device, num_processes=args.nproc, out=args.out, quick=args.quick)
    print(f"wrote {args.out}: {profile.device_name}, {len(profile.matmul)} matmul and "
          f"{len(profile.collectives)} collective measurements")
    if args.no_calibrate or "RANK" in os.environ:
        return 0
    if profile.device_kind == "cpu" and args.nproc >= 2:  # the default: whole steps of a small built-in model
        args.calibrate = list(DEFAULT_CALIBRATION_MODELS)
        return _calibrate(args, exists=True)
    print(_uncalibrated_note(profile.device_kind, args.out))
    return 0


def _uncalibrated_note(device_kind: str, out: str) -> str:
    """What to run for a calibrated profile where `autopar profile` could not calibrate on its own."""
    if device_kind == "cpu":
        return (f"not calibrated: whole steps need --nproc N >= 2 (`autopar profile --nproc 4 --out {out}`); plans "
                "on this profile say they are uncalibrated")
    return ("not calibrated: on GPUs calibrate inside the job, `torchrun --nproc-per-node N -m autopar.cli profile "
            f"{' '.join('--calibrate ' + spec for spec in DEFAULT_CALIBRATION_MODELS)} --out {out} --cluster PRESET:nodes=1,profile={out}`; plans on "
            "this profile say they are uncalibrated")


def _calibrate(args, *, exists: bool) -> int:
    import os

    from autopar.tune.profile import profile_machine
    from autopar.tune.calibrate import calibrate_profile, describe_calibration

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _calibrate_in_job(args, exists=exists)
    if args.cluster is not None:
        raise ConfigError("--cluster is for --calibrate inside a torchrun job (every process of the job runs the "
                          "configurations); without torchrun give --nproc N and the processes are spawned here")
    if args.nproc < 2:
        raise ConfigError("--calibrate runs parallel configurations: give --nproc N with N >= 2")
    if not exists:
        profile_machine(device=args.device, num_processes=args.nproc, out=args.out, quick=args.quick)
    profile = calibrate_profile(args.calibrate, args.out, num_processes=args.nproc, global_batch=args.global_batch)
    calibration = next(c for c in profile.calibrations if c.num_processes == args.nproc)
    print(describe_calibration(calibration))
    print(f"wrote {args.out}")
    return 0


def _calibrate_in_job(args, *, exists: bool) -> int:
    import os

    import torch.distributed as dist

    from autopar.tune.calibrate import calibrate_in_job, describe_calibration

    if not exists:
        raise ConfigError(f"--calibrate inside a torchrun job calibrates an existing profile, and '{args.out}' does "
                          f"not exist: measure it first with `autopar profile --out {args.out}` on one of the nodes")
    profile = calibrate_in_job(args.calibrate, args.out, cluster=args.cluster, global_batch=args.global_batch)
    if profile is not None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        print(describe_calibration(next(c for c in profile.calibrations if c.num_processes == processes)))
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _tune(args) -> int:
    from autopar.tune.command import tune

    constraints = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "zero_stage": args.zero,
                   "sequence_parallel": False if args.sequence_parallel == "off" else None}
    return tune(args.model, cluster=args.cluster, global_batch=args.global_batch, num_trials=args.trials,
                steps=args.steps, constraints={k: v for k, v in constraints.items() if v is not None},
                precision=args.precision, out=args.out, as_json=args.json, optimizer=args.optimizer)


def _show(args) -> int:
    from autopar.plans.plan import Plan

    plan = Plan.load(args.plan_file)
    written = report_commands.write_pictures(plan, timeline=args.timeline, memory=args.memory, html_path=args.html)
    print("\n".join(written) if written and not args.json else plan.to_json() if args.json else plan.summary())
    return 0


def _graph(args) -> int:
    from autopar.report.graph_summary import graph_summary

    print(graph_summary(planning.capture_for_planning(args.model)))
    return 0


def _verify(args) -> int:
    import json

    from autopar.tune.verify import format_table, select_kinds, verify

    kinds = [name.strip() for name in args.kinds.split(",") if name.strip()] if args.kinds is not None else None
    if kinds is not None and not kinds:
        raise ConfigError("--kinds needs at least one kind, e.g. --kinds dp,tp,pp")
    select_kinds(args.nproc, kinds)  # bad kinds fail before the model is built
    report = verify(args.model, num_processes=args.nproc, steps=args.steps, kinds=kinds,
                    progress=lambda message: print(f"verify: {message}", file=sys.stderr, flush=True))
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_table(report))
    return 0 if report.ok else 1


def _models(args) -> int:
    from autopar.models import list_models

    for name, description in list_models().items():
        print(f"{name:<16} {description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`autopar profile --calibrate MODEL`: measure whole steps and fit the terms the model lacks.

A fixed set of configurations of each MODEL (one or more; by default a small built-in GPT,
defaults.DEFAULT_CALIBRATION_MODELS) on N processes of this machine (every mesh pp x dp x tp
of N that the model allows, each with one and with more microbatches, ZeRO-3 where dp > 1,
ZeRO-1 for pure data parallelism, and full recomputation once without and once with tensor
parallelism: `calibration_configs`) is priced
without calibration and run for a few steps (autopar.tune.trials, the same measurement as
`trials=`, in interleaved rounds); the terms of cost_model/calibration.py are fitted to the measured step times
(fit.py, one fit over every model's configurations) and stored in the profile, replacing an earlier calibration for the same number of
processes.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone

from autopar.errors import ConfigError, ProfileError
from autopar.tune.fit import Observation, fit, unexercised_terms
from autopar.tune.trials import TrialOptions
from cost_model.calibration import CALIBRATION_VERSION, Calibration
from cost_model.errors import CostModelInputError
from cost_model.profile import HardwareProfile, load_profile

CALIBRATION_STEPS = TrialOptions(warmup_steps=2, steps=5, interleave=True)
"""Interleaved rounds (load from other jobs falls on every configuration alike), each to the end."""
MAX_CONFIGS = 13
MODEL_SEPARATOR = " ; "
"""Between the model specs of a calibration made on several (Calibration.model)."""


def calibration_configs(num_processes: int, global_batch: int, *, num_layers: int, num_heads: int) -> list[dict]:
    """The fixed set: constraint dicts for `planning.fixed_config` (at most MAX_CONFIGS)."""
    configs: list[dict] = []
    for pp in _divisors(num_processes):
        for tp in _divisors(num_processes // pp):
            dp = num_processes // (pp * tp)
            if (num_heads and num_heads % tp) or pp > num_layers or global_batch % dp:
                continue
            local = global_batch // dp
            fewest = pp  # 1F1B needs at least as many microbatches as stages
            for m in sorted({fewest, 2 * fewest}):
                if local % m == 0:
                    configs.append(dict(dp=dp, tp=tp, pp=pp, microbatch_size=local // m, zero_stage=0))
            if dp > 1 and local % fewest == 0:
                configs.append(dict(dp=dp, tp=tp, pp=pp, microbatch_size=local // fewest, zero_stage=3))
                if tp == 1 and pp == 1:
                    configs.append(dict(dp=dp, tp=1, pp=1, microbatch_size=local, zero_stage=1))
    if configs:
        configs.append({**configs[0], "recompute": "full"})
        # Recomputing, a tensor-parallel stage dispatches every op through DTensor (no local runs),
        # so this point's DTensor ops grow about 3x against 1.5x for its collectives: what tells
        # framework.dtensor_dispatch from comm.pattern, which the other points move together.
        sharded = next((c for c in configs if c["tp"] > 1 and c["pp"] == 1 and c["zero_stage"] == 0), None)
        if sharded is not None:
            configs.append({**sharded, "recompute": "full"})
    # Keep the variety when there are too many: every mesh's first, then the rest in order.
    firsts = [c for i, c in enumerate(configs) if i == 0 or _mesh(c) != _mesh(configs[i - 1])]
    rest = [c for c in configs if c not in firsts]
    return (firsts + rest)[:MAX_CONFIGS]


def _mesh(config: dict) -> tuple:
    return config["dp"], config["tp"], config["pp"]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def measure_configs(model_spec: str, cluster: str, global_batch: int, options: TrialOptions,
                    configs: list[dict] | None = None, precision: str = "fp32") -> list[dict]:
    """Every rank of a process group: price (rank 0, on `cluster`, whose profile is the one to
    calibrate) and run each configuration; returns per configuration its config, uncalibrated
    prediction, features and measured time (None when it failed)."""
    import torch
    import torch.distributed as dist

    from autopar.plans import planning
    from autopar.codegen.runtime import run_on_rank0
    from autopar.models import build_model
    from autopar.tune.trials import run_trials

    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundle = build_model(model_spec, device=device, seed=0, batch_size=global_batch)

    def price():
        planner = planning.planner_for(bundle.model, bundle.example_inputs, cluster, global_batch=global_batch,
                                  loss_fn=bundle.loss_fn, example_targets=bundle.example_targets,
                                  precision=precision, calibrated=False)
        if planner.cluster.num_devices != world:
            raise ConfigError(f"the calibration cluster '{cluster}' has {planner.cluster.num_devices} devices but the "
                              f"job has {world} processes: give the cluster of this job")
        chosen = configs if configs is not None else calibration_configs(
            world, global_batch, num_layers=getattr(bundle.config, "layers", 1),
            num_heads=getattr(bundle.config, "heads", 0))
        priced = []
        for constraints in chosen:
            config = planning.fixed_config(planner, tp=constraints["tp"], pp=constraints["pp"], dp=constraints["dp"],
                                      microbatch_size=constraints["microbatch_size"], schedule="1f1b",
                                      virtual_stages=None, layers_per_virtual_stage=None,
                                      recompute=constraints.get("recompute", "none"),
                                      zero_stage=constraints.get("zero_stage", 0))
            plan = planning.evaluate_with(planner, config)
            estimate, _ = planner.evaluate(config)
            priced.append((plan, planner.features(estimate)))
        return priced

    priced = run_on_rank0(price)
    plans = [plan for plan, _ in priced]
    say = (lambda message: print(f"calibrate: {message}", file=sys.stderr, flush=True))
    results = run_trials(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn, plans,
                         options=options, progress=say)
    return [dict(config=result.config, model=model_spec, predicted_s=plan.predicted.step_time_s, features=features,
                 measured_s=result.measured_s, failure=result.error)
            for (plan, features), result in zip(priced, results)]


def measure_models(model_specs: tuple[str, ...], cluster: str, global_batch: int, options: TrialOptions,
                   precision: str = "fp32") -> list[dict]:
    """`measure_configs` of each model in turn, in one process group: the rows of all of them."""
    return [row for spec in model_specs
            for row in measure_configs(spec, cluster, global_batch, options, precision=precision)]


def model_specs_of(models: str | Sequence[str]) -> tuple[str, ...]:
    """The calibration models as a tuple (one spec or several), each a non-empty spec."""
    specs = (models,) if isinstance(models, str) else tuple(models)
    if not specs:
        raise ConfigError("calibration needs at least one model spec, e.g. gpt:layers=4,hidden=128,heads=4")
    for spec in specs:
        check_calibration_model(spec)
    return specs


def calibrate_profile(models: str | Sequence[str], profile_path: str, *, num_processes: int,
                      global_batch: int | None = None, options: TrialOptions = CALIBRATION_STEPS,
                      out: str | None = None) -> HardwareProfile:
    """Run the calibration set of each of `models` on `num_processes` spawned gloo processes and
    store one fit over all of them in the profile (written to `out`, default: back to `profile_path`)."""
    from autopar.tune.launch import spawn

    specs = model_specs_of(models)

    profile = _profile_of_this_host(profile_path)
    if profile.device_kind != "cpu":
        raise ProfileError(f"profile '{profile_path}' is of {profile.device_name}: `autopar profile --calibrate` on "
                           "its own spawns gloo processes on this machine's CPUs; calibrate the GPUs inside a torchrun "
                           f"job: `torchrun --nproc-per-node N -m autopar.cli profile --calibrate MODEL --out "
                           f"{profile_path} --cluster PRESET:nodes=1,profile={profile_path}`")
    batch = global_batch or 4 * num_processes
    load, started = _load_average(), time.perf_counter()
    outcome = spawn(measure_models, num_processes=num_processes,
                    args=(specs, f"cpu:procs={num_processes},profile={profile_path}", batch, options))
    notes = [] if outcome.clean_exit else [
        f"the processes exited with codes {outcome.exit_codes} after the measurements (an abort at exit); the "
        "measurements were saved before"]
    calibrated = _with_calibration(profile, outcome.value, specs=specs, num_processes=num_processes,
                                   batch=batch, load=load, seconds=time.perf_counter() - started, notes=notes)
    calibrated.save(out or profile_path)
    return calibrated


def calibrate_in_job(models: str | Sequence[str], profile_path: str, *, cluster: str | None = None,
                     global_batch: int | None = None, options: TrialOptions = CALIBRATION_STEPS,
                     out: str | None = None) -> HardwareProfile | None:
    """The calibration inside this process group (a torchrun job: GPUs with NCCL, or CPUs with
    gloo), every rank calling it; `cluster` is the job's cluster with profile=`profile_path`
    (default for a CPU profile: cpu:procs=WORLD). Rank 0 fits, writes the profile and returns
    it; the other ranks return None."""
    import torch
    import torch.distributed as dist

    from autopar.codegen.runtime import ensure_process_group

    specs = model_specs_of(models)
    rank, world = ensure_process_group()
    processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_per_node))
    profile = _profile_of_this_host(profile_path)
    if cluster is None:
        if profile.device_kind != "cpu":
            raise ConfigError(f"calibrating {profile.device_name} needs the job's cluster: give --cluster "
                              f"PRESET:nodes=N,profile={profile_path} (the preset of these GPUs)")
        cluster = f"cpu:procs={world},profile={profile_path}"
    batch = global_batch or 4 * world
    load, started = _load_average(), time.perf_counter()
    rows = measure_models(specs, cluster, batch, options, precision="bf16" if profile.device_kind != "cpu" else "fp32")
    calibrated = None
    if rank == 0:
        calibrated = _with_calibration(profile, rows, specs=specs, num_processes=processes_per_node,
                                       batch=batch, load=load, seconds=time.perf_counter() - started, notes=[])
        calibrated.save(out or profile_path)
    dist.barrier()
    return calibrated


def _profile_of_this_host(profile_path: str) -> HardwareProfile:
    try:
        profile = load_profile(profile_path)
    except CostModelInputError as error:
        raise ProfileError(str(error)) from None
    if profile.host and profile.host != socket.gethostname():
        raise ProfileError(f"profile '{profile_path}' was measured on {profile.host}, not on this machine "
                           f"({socket.gethostname()}): calibrate with a profile of this machine")
    return profile


def _with_calibration(profile: HardwareProfile, rows: list[dict], *, specs: tuple[str, ...], num_processes: int,
                      batch: int, load: float, seconds: float, notes: list[str]) -> HardwareProfile:
    """`profile` with the fit of `rows` as its calibration for `num_processes` processes per node."""
    import torch

    notes = list(notes) + [f"{row['config']} of {row['model']} failed: {row['failure']}"
                           for row in rows if row["measured_s"] is None]
    observations = [Observation(config=row["config"], model=row["model"], predicted_s=row["predicted_s"], measured_s=row["measured_s"],
                                features=row["features"]) for row in rows if row["measured_s"] is not None]
    result = fit(observations)
    unseen = unexercised_terms(observations)
    if unseen:
        notes.append(f"no configuration exercised {', '.join(unseen)} (0 in every configuration's plan, e.g. "
                     "tensor-parallel plans fully replicated at this model's size): kept at their floor (a multiplier "
                     "1, a count term 0), so plans that run them are priced with nothing added for them; calibrate "
                     "on a model whose plans run them (--calibrate MODEL)")
    calibration = Calibration(
        version=CALIBRATION_VERSION, model=MODEL_SEPARATOR.join(specs), num_processes=num_processes, num_cores=os.cpu_count() or 1,
        host=profile.host, device_name=profile.device_name, torch_version=torch.__version__,
        coefficients=result.coefficients, expected_error=result.expected_error, worst_error=result.worst_error,
        points=tuple(replace(point, fitted_s=f, held_out_s=h)
                     for point, f, h in zip(observations, result.fitted_s, result.held_out_s)),
        load_average=load, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        notes=tuple(notes) + (f"global batch {batch}; {len(observations)} configurations in {seconds:.0f} s",))
    kept = tuple(c for c in profile.calibrations if c.num_processes != num_processes)
    return replace(profile, calibrations=kept + (calibration,))


def refit(calibration: Calibration) -> Calibration:
    """The calibration fitted again from its stored points (after a change to the fit)."""
    result = fit(list(calibration.points))
    points = tuple(replace(point, fitted_s=f, held_out_s=h)
                   for point, f, h in zip(calibration.points, result.fitted_s, result.held_out_s))
    return replace(calibration, coefficients=result.coefficients, expected_error=result.expected_error,
                   worst_error=result.worst_error, points=points)


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def describe_calibration(calibration: Calibration) -> str:
    models = calibration.model.split(MODEL_SEPARATOR)
    lines = [f"calibration of {' and '.join(models)} on {calibration.num_processes} processes "
             f"({calibration.num_cores} cores, load average {calibration.load_average:.1f} at the start):"]
    for term, value in calibration.coefficients.items():
        lines.append(f"  {term:<28} {value:.4g}")
    lines.append(f"  expected error (median held-out) {100 * calibration.expected_error:.0f}%, "
                 f"worst {100 * calibration.worst_error:.0f}%")
    for model in dict.fromkeys(point.model for point in calibration.points):
        if len(models) > 1 and model:
            lines.append(f"  {model}:")
        lines.append("  config                                                        predicted ms  held-out ms  "
                     "measured ms")
        for point in (p for p in calibration.points if p.model == model):
            lines.append(f"  {point.config:<62}{point.predicted_s * 1e3:10.1f}{point.held_out_s * 1e3:13.1f}"
                         f"{point.measured_s * 1e3:13.1f}")
    for note in calibration.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def check_calibration_model(model_spec: str) -> None:
    """The calibration builds MODEL with real weights from the registry."""
    if not isinstance(model_spec, str) or not model_spec:
        raise ConfigError("--calibrate needs a model spec, e.g. gpt:layers=4,hidden=256,heads=4")

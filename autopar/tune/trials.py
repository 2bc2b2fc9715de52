"""Trial runs: measure the best predicted plans on the real job and keep the measured winner.

    results = run_trials(model, inputs, targets, loss_fn, plans)      # on every rank
    index = select_winner(results)
    chosen = record_trials(plans[index], results, index)

Each candidate is built on a deep copy of the model (the user's parameters, their gradients and
any optimizer over them are never touched) and runs `warmup_steps + steps` training steps of
the example batch: `train_step` + an optimizer step on the copy (SGD unless `optimizer` says
otherwise), as the user's loop would. A step's time is the slowest rank's (all ranks agree on
it, so every rank takes the same decisions); a candidate's time is the median after warm-up.
A candidate whose first timed steps are all slower than `give_up_ratio` x the best median so
far cannot win and stops early. The global RNG state is restored after the trials, so that
the user's run (dropout, data order) is the same as without them.

A candidate that fails to build or run on every rank alike (an error, out of memory) is
recorded as failed and the others go on; a failure on some ranks only would leave the others
inside a collective, and is not recoverable in the same job.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from autopar.errors import ConfigError
from autopar.plans.plan import Plan


@dataclass(frozen=True, kw_only=True)
class TrialOptions:
    """How candidates are measured."""

    warmup_steps: int = 2
    """Steps run before timing (first-step allocation, autograd graph set-up, FSDP lazy init)."""
    steps: int = 5
    """Timed steps per candidate."""
    give_up_ratio: float = 1.5
    """Stop a candidate whose first `min_steps_before_giving_up` timed steps are all slower than
    this many times the best median so far."""
    min_steps_before_giving_up: int = 2
    """Timed steps a candidate always gets."""
    optimizer: Callable | None = None
    """Factory `optimizer(parameters)` for the copy's optimizer; default SGD(lr=1e-3)."""
    interleave: bool = False
    """Build every candidate first, then run the steps in rounds (one step of each candidate
    per round, the order rotating), so that load from other jobs that comes and goes falls on
    all candidates alike. Holds all candidates' copies at once, and never stops one early."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.steps < 1:
            raise ConfigError(f"trials need warmup_steps >= 0 and steps >= 1, got {self.warmup_steps} and {self.steps}")
        if self.give_up_ratio <= 1.0:
            raise ConfigError(f"give_up_ratio must be > 1, got {self.give_up_ratio}")


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What one candidate measured."""

    config: str
    """Its configuration (ParallelConfig.describe())."""
    predicted_s: float
    """Predicted step time."""
    measured_s: float | None
    """Median step time after warm-up (slowest rank); None when it failed."""
    step_times_s: tuple[float, ...] = ()
    """Every timed step."""
    setup_s: float = 0.0
    """Time to build the module (capture, placement, FSDP, pipeline)."""
    stopped_early: bool = False
    """Stopped because it could not beat the best so far."""
    error: str = ""
    """Why it failed."""
    moe_load_imbalance: float | None = None
    """Dropless expert layers run expert-parallel: the busiest ep rank's rows over the mean,
    averaged over the layers (ParallelModule.expert_load), what the price assumed; None without."""

    @property
    def relative_error(self) -> float | None:
        """predicted / measured - 1."""
        if not self.measured_s:
            return None
        return self.predicted_s / self.measured_s - 1.0

    def to_dict(self, chosen: bool = False) -> dict:
        return {"config": self.config, "predicted_s": self.predicted_s, "measured_s": self.measured_s,
                "error": self.relative_error, "steps_timed": len(self.step_times_s), "setup_s": self.setup_s,
                "stopped_early": self.stopped_early, "failure": self.error, "chosen": chosen,
                "moe_load_imbalance": self.moe_load_imbalance}


def select_winner(results: list[TrialResult]) -> int:
    """Index of the measured fastest candidate (ties: the earlier, i.e. better predicted); the
    predicted best (0) when none ran."""
    if not results:
        raise ConfigError("no candidate plans to choose from")
    measured = [(result.measured_s, index) for index, result in enumerate(results)
                if result.measured_s is not None and not result.stopped_early]
    return min(measured)[1] if measured else 0


def record_trials(plan: Plan, results: list[TrialResult], chosen: int) -> Plan:
    """`plan` (the winner) carrying every candidate's predicted and measured step time."""
    rows = tuple(result.to_dict(chosen=index == chosen) for index, result in enumerate(results))
    winner = results[chosen]
    note = (f"chosen by trials: measured {winner.measured_s * 1e3:.1f} ms per step (predicted "
            f"{winner.predicted_s * 1e3:.1f} ms), best of {len(results)} candidates" if winner.measured_s
            else f"trials: no candidate ran ({winner.error}); the predicted best is kept")
    notes = (note,)
    if winner.moe_load_imbalance is not None and plan.moe_load_imbalance is not None:
        notes += (f"measured MoE load imbalance {winner.moe_load_imbalance:.3g} (the busiest expert rank's rows over "
                  f"the mean, averaged over layers); priced with {plan.moe_load_imbalance:g}: re-plan with "
                  f"--moe-load-imbalance {max(1.0, winner.moe_load_imbalance):.3g} to price the routing measured",)
    return replace(plan, trials=rows, notes=plan.notes + notes)


def run_trials(model: torch.nn.Module, inputs: tuple, targets, loss_fn: Callable, plans: list[Plan], *,
               options: TrialOptions = TrialOptions(), progress: Callable[[str], None] | None = None,
               build: Callable | None = None, keywords: dict | None = None) -> list[TrialResult]:
    """Measure each plan on this job (call on every rank with the same arguments). `inputs` are
    the positional inputs and `keywords` the keyword inputs, as the plans were made with."""
    from autopar.codegen.parallelize import build_parallel_module

    if loss_fn is None or targets is None:
        raise ConfigError("trials run training steps: pass loss_fn and example_targets")
    if inputs and keywords:
        raise ConfigError("trials take positional inputs or keyword inputs, not both: pass every input by keyword "
                          "(a dict), or trials=1")
    build = build or build_parallel_module
    if keywords:
        build, inputs = _built_from_keywords(build, dict(keywords)), dict(keywords)
    say = progress if (progress and dist.get_rank() == 0) else (lambda message: None)
    saved_rng = _rng_state()
    results: list[TrialResult] = []
    best_s = float("inf")
    try:
        if options.interleave:
            return _interleaved(model, inputs, targets, loss_fn, plans, options, build, say)
        for index, plan in enumerate(plans):
            config = describe(plan)
            say(f"trial {index + 1}/{len(plans)}: {config} (predicted {plan.predicted.step_time_s * 1e3:.1f} ms)")
            result = _one_trial(model, inputs, targets, loss_fn, plan, options, best_s, build)
            results.append(result)
            if result.measured_s is not None and not result.stopped_early:
                best_s = min(best_s, result.measured_s)
            say(f"trial {index + 1}/{len(plans)}: " + (
                f"failed: {result.error}" if result.measured_s is None else
                f"measured {result.measured_s * 1e3:.1f} ms"
                + (" (stopped early: slower than the best)" if result.stopped_early else "")
                + f" after {result.setup_s:.1f} s set-up"))
    finally:
        _restore_rng(saved_rng)
    return results


def _built_from_keywords(build: Callable, keywords: dict) -> Callable:
    """`build` for a model called with keyword inputs only: the module is built from them, and
    its steps take them as one dict (the `inputs` the trial loops pass around)."""
    def build_with_keywords(model, _step_inputs, plan, loss_fn):
        return build(model, (), plan, loss_fn, keywords)
    return build_with_keywords


def _one_trial(model, inputs, targets, loss_fn, plan: Plan, options: TrialOptions, best_s: float,
               build: Callable) -> TrialResult:
    config, predicted = describe(plan), plan.predicted.step_time_s
    started = time.perf_counter()
    times: list[float] = []
    stopped = False
    error = ""
    pm = optimizer = trial_model = None
    try:
        trial_model = copy.deepcopy(model)
        pm = build(trial_model, inputs, plan, loss_fn)
        setup_s = time.perf_counter() - started
        optimizer = (options.optimizer or _default_optimizer)(pm.parameters())
        for step in range(options.warmup_steps + options.steps):
            step_s = _timed_step(pm, optimizer, inputs, targets)
            if step < options.warmup_steps:
                continue
            times.append(step_s)
            if len(times) >= options.min_steps_before_giving_up and min(times) > options.give_up_ratio * best_s:
                stopped = True
                break
    except Exception as caught:  # noqa: BLE001 - recorded; the other candidates still run
        error = f"{type(caught).__name__}: {caught}".splitlines()[0][:300]
        setup_s = time.perf_counter() - started
    error = _agree_on_failure(error)
    imbalance = None if error else _measured_imbalance(pm)
    del pm, optimizer, trial_model
    gc.collect()
    if error:
        return TrialResult(config=config, predicted_s=predicted, measured_s=None, setup_s=setup_s, error=error)
    return TrialResult(config=config, predicted_s=predicted, measured_s=statistics.median(times),
                       step_times_s=tuple(times), setup_s=setup_s, stopped_early=stopped,
                       moe_load_imbalance=imbalance)


def _measured_imbalance(pm) -> float | None:
    """The mean over expert layers of ParallelModule.expert_load (None without dropless ep layers)."""
    load = pm.expert_load() if hasattr(pm, "expert_load") else {}
    return statistics.fmean(load.values()) if load else None


def _interleaved(model, inputs, targets, loss_fn, plans: list[Plan], options: TrialOptions, build: Callable,
                 say: Callable[[str], None]) -> list[TrialResult]:
    """Every candidate built, then rounds of one step each (see TrialOptions.interleave)."""
    built: list[tuple | None] = []
    setups, errors = [], []
    for index, plan in enumerate(plans):
        say(f"building {index + 1}/{len(plans)}: {describe(plan)}")
        started, error, entry = time.perf_counter(), "", None
        try:
            pm = build(copy.deepcopy(model), inputs, plan, loss_fn)
            entry = (pm, (options.optimizer or _default_optimizer)(pm.parameters()))
        except Exception as caught:  # noqa: BLE001 - recorded; the other candidates still run
            error = f"{type(caught).__name__}: {caught}".splitlines()[0][:300]
        error = _agree_on_failure(error)
        built.append(None if error else entry)
        setups.append(time.perf_counter() - started)
        errors.append(error)
    times: list[list[float]] = [[] for _ in plans]
    rounds = options.warmup_steps + options.steps
    for round_index in range(rounds):
        say(f"round {round_index + 1}/{rounds}")
        for offset in range(len(plans)):
            index = (round_index + offset) % len(plans)
            if built[index] is None:
                continue
            try:
                step_s = _timed_step(built[index][0], built[index][1], inputs, targets)
                failure = ""
            except Exception as caught:  # noqa: BLE001
                failure = f"{type(caught).__name__}: {caught}".splitlines()[0][:300]
            failure = _agree_on_failure(failure)
            if failure:
                built[index], errors[index] = None, failure
            elif round_index >= options.warmup_steps:
                times[index].append(step_s)
    results = []
    for plan, entry, step_times, setup_s, error in zip(plans, built, times, setups, errors):
        measured = statistics.median(step_times) if step_times and not error else None
        imbalance = _measured_imbalance(entry[0]) if entry is not None and not error else None
        results.append(TrialResult(config=describe(plan), predicted_s=plan.predicted.step_time_s, measured_s=measured,
                                   step_times_s=tuple(step_times), setup_s=setup_s, error=error,
                                   moe_load_imbalance=imbalance))
    del built
    gc.collect()
    return results


def _timed_step(pm, optimizer, inputs, targets) -> float:
    """One training step; the slowest rank's wall time (the same value on every rank)."""
    dist.barrier()
    started = time.perf_counter()
    pm.train_step(inputs, targets)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _agree_on_failure(error: str) -> str:
    """Every rank learns whether any rank failed (first message wins)."""
    if dist.get_world_size() == 1:
        return error
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((item for item in errors if item), "")


def _default_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=1e-3)


def describe(plan: Plan) -> str:
    mesh = plan.mesh
    schedule = plan.schedule + (f"(v={plan.virtual_stages})" if plan.schedule in ("interleaved", "zb1p") else "")
    experts = f" ep={plan.ep}" if plan.ep > 1 else ""
    cp = f" cp={mesh['cp']}" if mesh.get("cp", 1) > 1 else ""
    return (f"dp={mesh['dp']}{experts}{cp} tp={mesh['tp']} pp={mesh['pp']} microbatch={plan.microbatch_size}x"
            f"{plan.num_microbatches} {schedule} recompute={plan.recompute} zero={plan.zero_stage}")


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)

"""The public API: plan, evaluate and parallelize a model for a cluster.

    plan = autopar.plan(model, example_inputs, "dgx-a100-80g:nodes=16", global_batch=1024)
    print(plan.summary())
    pm = autopar.parallelize(model, "dgx-h100:nodes=2", example_inputs)   # inside torchrun
    report = autopar.verify("my_model.py:tiny", num_processes=4)         # is its sharding exact?

Planning (capture, search, building the Plan) lives in plans/planning.py and building this
rank's module in codegen/parallelize.py; `parallelize` joins them, with trial runs of the best
candidates (tune/trials.py) when asked. `verify` (tune/verify.py) trains a tiny copy of a model
under each plan kind on spawned processes against one process. This module sits above codegen, tune and report because
`parallelize` uses all three; those stages import plans/planning.py, never this module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.parallel_module import ParallelModule
from autopar.codegen.parallelize import build_parallel_module
from autopar.codegen.runtime import ensure_process_group, run_on_rank0
from autopar.codegen.training_loop import DEFAULT_CHECKPOINT_EVERY, CheckpointPolicy
from autopar.errors import ConfigError, PlanMismatchError
from autopar.plans import planning
from autopar.plans.plan import Plan
from autopar.plans.planning import (candidate_plans, candidates_with, capture_for_planning, check_model_arguments,
                                    evaluate, evaluate_with, fixed_config, plan_with, planner_for, split_inputs)
from autopar.tune.trials import TrialOptions, record_trials, run_trials, select_winner
from autopar.tune.verify import VerifyReport, verify
from autopar.validation import check_global_batch, shorten, type_name

plan = planning.plan
"""`autopar.plan(model, example_inputs, cluster, global_batch=...)`: see plans/planning.py."""

__all__ = ["candidate_plans", "candidates_with", "capture_for_planning", "default_cluster", "evaluate",
           "evaluate_with", "fixed_config", "parallelize", "plan", "plan_with", "planner_for", "split_inputs",
           "verify", "VerifyReport"]

_GPU_PRESETS = ((" B200", "dgx-b200"), ("H200", "hgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80g"),
                ("V100", "p3-16xlarge"))
"""torch.cuda.get_device_name() markers ("NVIDIA B200"; a GB200, whose NVLink domain is not a DGX
node's, matches none)."""


def default_cluster(world_size: int) -> str:
    """This job's machine as a cluster spec: the local CPU, or the matching GPU preset."""
    if not torch.cuda.is_available():
        return f"cpu:procs={world_size}"
    name = torch.cuda.get_device_name()
    per_node = min(torch.cuda.device_count(), world_size)
    for marker, preset in _GPU_PRESETS:
        if marker in name:
            return f"{preset}:nodes={max(world_size // per_node, 1)},gpus_per_node={per_node}"
    raise ConfigError(f"no cluster preset matches GPU '{name}': pass cluster= (a preset spec or a TOML file)")


def parallelize(model: nn.Module, cluster=None, example_inputs=None, *, plan: Plan | str | Path | None = None,
                loss_fn: Callable | None = None, example_targets=None, global_batch: int | None = None,
                constraints=None, precision: str | None = None, example_kwargs: dict | None = None,
                init_fn=None, trials: int = 1, trial_options=None, progress=None, options=None,
                checkpoint: str | Path | None = None, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
                checkpoint_async: bool = True, fp8_recipe: str = "tensorwise", fp8_filter=None,
                fp8_casts: str | None = None, tp_overlap: str | None = None) -> ParallelModule:
    """Plan (on rank 0) or take `plan`, and return this rank's ParallelModule. `example_inputs`
    is a tuple of positional inputs or a dict of keyword inputs (`input_ids=`, `attention_mask=`);
    `example_kwargs` adds keyword inputs to positional ones.

    A model on meta gets storage for this rank's shards only, initialised by `init_fn(model)`,
    else its `init_weights()` / `reset_parameters()`; `init_fn` may instead be a checkpoint path
    (a DCP folder saved by `pm.save`, or a `.safetensors` file / folder) to load.

    With `trials=k` > 1 the k best predicted plans each run a few training steps on a copy of
    the model in this job (tune/trials.py) and the measured fastest is built; the plan
    records every candidate's predicted and measured step time. `trial_options` is a
    TrialOptions; `progress(message)` receives trial progress on rank 0 (default: stderr).
    `options` is the planner's SearchOptions (e.g. `SearchOptions(optimizer="fused")` when the
    script builds `AdamW(..., fused=True)`: the optimizer step is priced as it will run).

    `checkpoint` (a folder) makes the job elastic: `pm.steps(...)` resumes from its newest complete
    checkpoint and saves one every `checkpoint_every` steps (asynchronously unless
    `checkpoint_async=False`); a `plan` made for another number of processes (torchrun restarted
    the job on fewer or more nodes) is replaced by one planned for this world, with the plan's
    global batch (codegen/training_loop.py).

    `precision="fp8"` trains the linears that solver/fp8.py picks (or `fp8_filter(module_fqn,
    weight_shape)` keeps) in float8 with torchao's `fp8_recipe` ("tensorwise" or "rowwise"), the casts
    compiled by torch.compile or run eagerly as `fp8_casts` says ("compiled" or "eager"; default:
    compiled on GPU clusters, eager on CPU ones). `tp_overlap` is how sequence parallelism's
    collectives run: "async" (fused with their GEMMs, torch's async TP; the default on CUDA
    clusters) or "off" (DTensor's)."""
    _check_arguments(model, example_inputs, example_kwargs, plan, global_batch)
    _, world = ensure_process_group()
    inputs, keywords = split_inputs(example_inputs, example_kwargs)
    batch = global_batch or _batch_of(inputs + tuple(keywords.values()))

    def make_plan() -> Plan:
        if plan is not None:
            return plan if isinstance(plan, Plan) else Plan.load(plan)
        return planning.plan(model, inputs, cluster or default_cluster(world), global_batch=batch,
                             constraints=constraints, loss_fn=loss_fn, example_targets=example_targets,
                             example_kwargs=keywords, options=options, fp8_recipe=fp8_recipe, fp8_filter=fp8_filter,
                             fp8_casts=fp8_casts, tp_overlap=tp_overlap,
                             precision=precision or ("bf16" if torch.cuda.is_available() else "fp32"))

    if trials > 1 and plan is None:
        chosen = _chosen_by_trials(model, inputs, keywords, cluster or default_cluster(world), batch, trials,
                                   loss_fn=loss_fn, example_targets=example_targets, constraints=constraints,
                                   precision=precision or ("bf16" if torch.cuda.is_available() else "fp32"),
                                   trial_options=trial_options, progress=progress, options=options,
                                   fp8=dict(fp8_recipe=fp8_recipe, fp8_filter=fp8_filter, fp8_casts=fp8_casts,
                                            tp_overlap=tp_overlap))
    elif trials < 1:
        raise ConfigError(f"trials must be >= 1 (1: no trial runs), got {trials}")
    else:
        chosen = run_on_rank0(make_plan)
    if chosen.num_devices != world and checkpoint is not None:
        chosen = _replanned(chosen, world, model, inputs, keywords, cluster, loss_fn=loss_fn,
                            example_targets=example_targets, constraints=constraints, options=options)
    if chosen.num_devices != world:
        raise PlanMismatchError(f"this plan is for {chosen.num_devices} devices (mesh {chosen.mesh}), but the job "
                                f"has {world} processes: launch {chosen.num_devices} or re-plan")
    pm = build_parallel_module(model, inputs, chosen, loss_fn, keywords, init_fn=init_fn)
    if checkpoint is not None:
        pm.checkpointing = CheckpointPolicy(folder=Path(checkpoint), every_steps=checkpoint_every,
                                            asynchronous=checkpoint_async)
    return pm


def _replanned(given: Plan, world: int, model, inputs, keywords, cluster, *, loss_fn, example_targets, constraints,
               options) -> Plan:
    """A plan for this world in place of `given` (made for another), with its global batch and
    precision; the capture comes from the capture cache when the model was planned before."""
    def make() -> Plan:
        print(f"autopar: the plan is for {given.num_devices} processes, the job has {world}: re-planning",
              file=sys.stderr, flush=True)
        return planning.plan(model, inputs, cluster or default_cluster(world), global_batch=given.global_batch,
                             constraints=constraints, loss_fn=loss_fn, example_targets=example_targets,
                             example_kwargs=keywords, options=options, precision=given.precision,
                             **({"fp8_recipe": given.fp8_recipe, "fp8_casts": given.fp8_casts or "eager"}
                                if given.precision == "fp8" else {}))

    return run_on_rank0(make)


def _chosen_by_trials(model, inputs, keywords, cluster, batch: int, trials: int, *, loss_fn, example_targets, constraints,
                      precision: str, trial_options, progress, options=None, fp8: dict | None = None) -> Plan:
    candidates = run_on_rank0(lambda: candidate_plans(
        model, inputs, cluster, global_batch=batch, num_candidates=trials, constraints=constraints, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, example_kwargs=keywords, options=options,
        **(fp8 or {})))
    for candidate in candidates:
        if candidate.num_devices != dist.get_world_size():
            raise PlanMismatchError(f"the candidate plans are for {candidate.num_devices} devices, but the job has "
                                    f"{dist.get_world_size()} processes: plan for this job's cluster")
    say = progress or (lambda message: print(f"autopar: {message}", file=sys.stderr, flush=True))
    results = run_trials(model, inputs, example_targets, loss_fn, candidates, options=trial_options or TrialOptions(),
                         progress=say, keywords=keywords)
    winner = select_winner(results)
    return record_trials(candidates[winner], results, winner)


def _check_arguments(model, example_inputs, example_kwargs, plan, global_batch) -> None:
    """Before joining the process group: a wrong argument fails alike on every rank, at once."""
    if not isinstance(model, nn.Module) or isinstance(model, type):
        hint = " (build it first, e.g. build_model('gpt').model)" if isinstance(model, str) else ""
        raise ConfigError(f"parallelize takes the model itself, an nn.Module instance, got {type_name(model)} "
                          f"{shorten(model)}{hint}")
    if example_inputs is None and not example_kwargs:
        raise ConfigError("parallelize needs example_inputs: a tuple of tensors like one global batch "
                          "(or a dict of keyword inputs)")
    check_model_arguments(model, example_inputs)
    if global_batch is not None:
        check_global_batch(global_batch)
    if isinstance(plan, Plan):
        plan.validate()
    elif plan is not None and not isinstance(plan, (str, Path)):
        raise ConfigError(f"plan must be a Plan, the path of a plan file or None, got {type_name(plan)} "
                          f"{shorten(plan)}")


def _batch_of(inputs: tuple) -> int:
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError("could not tell the batch size from example_inputs: pass global_batch=")

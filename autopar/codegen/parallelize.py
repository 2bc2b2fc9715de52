"""`autopar.parallelize`: plan on rank 0 (or load a plan), then build this rank's module.

Every rank: joins the process group (NCCL on GPUs, gloo on CPUs), receives the plan, checks it
matches the job's size and the model (fingerprint of the captured graph), builds the device
mesh, distributes the parameters as the plan places them, shards them over dp (ZeRO) and sets up
the pipeline schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.codegen import context_parallel
from autopar.codegen.build import ProgramBuilder, chunk_specs
from autopar.codegen.data_parallel import apply_fsdp, uses_fsdp
from autopar.codegen.interpreter import RunStats
from autopar.codegen.listing import program_listing
from autopar.codegen.loss_parallel import ModelLoss
from autopar.codegen.parallel_module import ParallelModule
from autopar.codegen.pipeline import PipelineBuilder, boundary_wires, tied_weight_groups
from autopar.codegen.placements import to_dtensor_placement
from autopar.solver.pipeline import rank_of
from autopar.codegen.program import GraphParts
from autopar.codegen.init import all_names
from autopar.codegen.runtime import agree, build_runtime, ensure_process_group, register_shutdown, run_on_rank0
from autopar.errors import AutoparError, ConfigError, PlanMismatchError
from autopar.plans import Plan

_GPU_PRESETS = (("H200", "hgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80g"), ("V100", "p3-16xlarge"))


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
                init_fn=None, trials: int = 1, trial_options=None, progress=None, options=None) -> ParallelModule:
    """Plan (on rank 0) or take `plan`, and return this rank's ParallelModule. `example_inputs`
    is a tuple of positional inputs or a dict of keyword inputs (`input_ids=`, `attention_mask=`);
    `example_kwargs` adds keyword inputs to positional ones.

    A model on meta gets storage for this rank's shards only, initialised by `init_fn(model)`,
    else its `init_weights()` / `reset_parameters()`; `init_fn` may instead be a checkpoint path
    (a DCP folder saved by `pm.save`, or a `.safetensors` file / folder) to load.

    With `trials=k` > 1 the k best predicted plans each run a few training steps on a copy of
    the model in this job (autopar.tune.trials) and the measured fastest is built; the plan
    records every candidate's predicted and measured step time. `trial_options` is a
    TrialOptions; `progress(message)` receives trial progress on rank 0 (default: stderr).
    `options` is the planner's SearchOptions (e.g. `SearchOptions(optimizer="fused")` when the
    script builds `AdamW(..., fused=True)`: the optimizer step is priced as it will run)."""
    from autopar import api

    _check_arguments(model, example_inputs, example_kwargs, plan, global_batch)
    _, world = ensure_process_group()
    inputs, keywords = api.split_inputs(example_inputs, example_kwargs)
    batch = global_batch or _batch_of(inputs + tuple(keywords.values()))

    def make_plan() -> Plan:
        if plan is not None:
            return plan if isinstance(plan, Plan) else Plan.load(plan)
        return api.plan(model, inputs, cluster or default_cluster(world), global_batch=batch,
                        constraints=constraints, loss_fn=loss_fn, example_targets=example_targets,
                        example_kwargs=keywords, options=options,
                        precision=precision or ("bf16" if torch.cuda.is_available() else "fp32"))

    if trials > 1 and plan is None:
        chosen = _chosen_by_trials(model, inputs, keywords, cluster or default_cluster(world), batch, trials,
                                   loss_fn=loss_fn, example_targets=example_targets, constraints=constraints,
                                   precision=precision or ("bf16" if torch.cuda.is_available() else "fp32"),
                                   trial_options=trial_options, progress=progress, options=options)
    elif trials < 1:
        raise ConfigError(f"trials must be >= 1 (1: no trial runs), got {trials}")
    else:
        chosen = run_on_rank0(make_plan)
    if chosen.num_devices != world:
        raise PlanMismatchError(f"this plan is for {chosen.num_devices} devices (mesh {chosen.mesh}), but the job "
                                f"has {world} processes: launch {chosen.num_devices} or re-plan")
    return build_parallel_module(model, inputs, chosen, loss_fn, keywords, init_fn=init_fn)


def _chosen_by_trials(model, inputs, keywords, cluster, batch: int, trials: int, *, loss_fn, example_targets, constraints,
                      precision: str, trial_options, progress, options=None) -> Plan:
    import sys

    from autopar import api
    from autopar.tune.trials import TrialOptions, record_trials, run_trials, select_winner

    candidates = run_on_rank0(lambda: api.candidate_plans(
        model, inputs, cluster, global_batch=batch, num_candidates=trials, constraints=constraints, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, example_kwargs=keywords, options=options))
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
    from autopar.api import check_model_arguments
    from autopar.validation import check_global_batch, shorten, type_name

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


def build_parallel_module(model: nn.Module, inputs: tuple, plan: Plan, loss_fn, keywords: dict | None = None, *,
                          captured: tuple | None = None, init_fn=None) -> ParallelModule:
    """This rank's module for `plan`. `captured` is `capture_program(model, inputs, keywords)`'s
    result when the caller has it already (building the same model for several plans); `init_fn`
    initialises meta-born storage (see `parallelize`)."""
    from autopar.capture import capture_program

    keywords = dict(keywords or {})
    cp = plan.mesh.get("cp", 1)
    error: AutoparError | None = None
    parts, seq_len = None, 0
    try:
        program, graph = captured or capture_program(model, inputs, keywords, allow_fallback=False)
        plan.check_matches(model_fingerprint=graph.fingerprint(), num_devices=dist.get_world_size(),
                           model_name=type(model).__name__)
        if cp > 1:  # the program each rank runs is the model at its share of the sequence
            program, graph, seq_len = context_parallel.local_program(model, inputs, keywords, graph, plan)
        parts = GraphParts.read(program, graph)
    except AutoparError as caught:
        error = caught
    agree(error)
    if plan.ep > 1 and plan.zero_stage != 0:
        raise ConfigError(f"the plan has ep={plan.ep} with ZeRO-{plan.zero_stage}: expert parallelism runs with "
                          "ZeRO-0 only (FSDP of expert-sharded weights is not built); re-plan with zero_stage=0")
    runtime = build_runtime(plan.mesh, ep=plan.ep)
    _factories_on(parts.program, runtime.device)
    stats = RunStats()
    builder = ProgramBuilder(plan, parts, model, runtime.tp_mesh, runtime.device, stats)
    if plan.ep > 1:
        builder.use_expert_parallelism(runtime)
    cp_ops = context_parallel.ops_for(parts, seq_len, runtime) if cp > 1 else None
    if cp_ops is not None:
        cp_ops.install(builder.interpreter)
    specs = chunk_specs(plan, parts)
    if len(specs) > 1:
        builder.wires = boundary_wires(plan, parts, builder.placements, specs)
    pp, pp_rank = plan.mesh["pp"], runtime.coordinate("pp")
    mine = [spec for spec in specs if rank_of(plan.schedule, stage=spec.index, num_ranks=pp) == pp_rank]
    stages = [builder.build(spec, num_chunks=len(specs)) for spec in mine]
    if uses_fsdp(plan.zero_stage, plan.mesh["dp"] * cp, plan.offload):
        apply_fsdp(stages, runtime.reduce_mesh, plan.zero_stage, offload=plan.offload,
                   param_dtype=torch.bfloat16 if plan.precision == "bf16" else None)
    schedule, tied = None, {}
    if len(specs) > 1:
        pipeline = PipelineBuilder(plan, parts, builder.placements, runtime.device, runtime.pp_group, builder.wires)
        pipeline_stages = [pipeline.stage(stage, spec, len(specs)) for stage, spec in zip(stages, mine)]
        shards = (runtime.tp_mesh, [builder.placements.get(name, "R").split("|")[0] for name in specs[-1].outputs]) \
            if plan.loss_parallel else None
        schedule = pipeline.schedule(pipeline_stages, _pipeline_loss(loss_fn, parts.model_output, shards))
        tied = tied_weight_groups(plan, parts, [spec.segments for spec in specs],
                                  (pp, plan.mesh["dp"] * cp, plan.mesh["tp"]), runtime.rank)  # dp, cp: one axis
    coordinate = {axis: runtime.coordinate(axis) for axis in ("pp", "dp", "tp")}
    listing = program_listing(plan, parts, builder.placements, mine, coordinate)
    flat_inputs = inputs + tuple(keywords.values())
    input_shapes = tuple(tuple(value.shape) if isinstance(value, torch.Tensor) else () for value in flat_inputs)
    module_class, extra = (context_parallel.ContextParallelModule, {"seq_len": seq_len, "ops": cp_ops}) if cp_ops \
        else (ParallelModule, {})
    module = module_class(**extra, plan=plan, runtime=runtime, stages=stages, loss_fn=loss_fn, params=builder.params,
                          expert_params=frozenset(plan.ep_params),
                          input_shapes=input_shapes, keyword_names=tuple(keywords), model_output=parts.model_output,
                          listing=listing, stats=stats, schedule=schedule, tied_groups=tied,
                          weight_casts=builder.weight_casts,
                          has_first=mine[0].index == 0, has_last=mine[-1].index == len(specs) - 1)
    module.persistent_buffers = {fqn: tensor for fqn, tensor in builder.buffers.items()
                                 if fqn in _persistent_buffer_names(model)}
    module.parameter_aliases = {first: names[1:] for first, names in all_names(model).items() if len(names) > 1}
    _initialise(module, model, builder, init_fn)
    register_shutdown()
    return module


def _factories_on(program, device: torch.device) -> None:
    """A model captured on meta bakes `device=meta` into the tensors its forward creates
    (`torch.ones(n, device=x.device)`): make them on this rank's device instead."""
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device) \
                and node.kwargs["device"].type == "meta":
            node.update_kwarg("device", device)


def _persistent_buffer_names(model: nn.Module) -> set[str]:
    return {f"{prefix}.{name}" if prefix else name for prefix, owner in model.named_modules()
            for name in owner._buffers if name not in owner._non_persistent_buffers_set}


def _initialise(module: ParallelModule, model: nn.Module, builder: ProgramBuilder, init_fn) -> None:
    """Fill the storage of meta-born tensors by running the model's init on this rank's shards,
    then load the checkpoint when `init_fn` names one (every rank takes part: both are collective)."""
    checkpoint = init_fn if isinstance(init_fn, (str, Path)) else None
    init_fn = None if checkpoint is not None else init_fn
    if init_fn is not None or agree_any(bool(builder.meta_born), module.runtime.device):
        _run_init(module, model, builder, init_fn)
    if checkpoint is not None:  # after the init: buffers that are not saved (rotary tables) come from it
        module.load(checkpoint)


def _run_init(module: ParallelModule, model: nn.Module, builder: ProgramBuilder, init_fn) -> None:
    from autopar.codegen.init import initialise
    from autopar.codegen.runtime import broadcast_object

    seed = broadcast_object(torch.initial_seed())
    params = module.named_model_parameters()
    everything = init_fn is not None
    mine = {fqn: tensor for fqn, tensor in params.items() if everything or fqn in builder.meta_born}
    buffers = {fqn: tensor for fqn, tensor in builder.buffers.items() if everything or fqn in builder.meta_born}
    # Real tensors the init must not overwrite are hidden behind meta stand-ins.
    for fqn, tensor in params.items():
        if fqn not in mine:
            mine[fqn] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    error: AutoparError | None = None
    try:
        initialise(model, mine, buffers, init_fn=init_fn, seed=seed)
    except AutoparError as caught:
        error = caught
    agree(error)


def agree_any(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (ranks of other pipeline stages see other tensors)."""
    if dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value)
    return bool(value.item())


def _pipeline_loss(loss_fn, model_output, shards=None):
    """The schedule's loss: the last stage's tensors become the model's own output object
    (a ModelOutput, a tuple...), which `loss_fn` receives as it does in planning. `shards`:
    (tp mesh, planned placement of each output) when the last stage hands over its local shards
    for a class-sharded loss (plan.loss_parallel): they become DTensors again."""
    if loss_fn is None:
        return None
    model_loss = ModelLoss(loss_fn, model_output, sharded=shards is not None)

    def loss(output, target):
        flat = output if isinstance(output, tuple) else (output,)
        if shards is not None:
            mesh, placements = shards
            flat = tuple(DTensor.from_local(value, mesh, [to_dtensor_placement(placement)], run_check=False)
                         if isinstance(value, torch.Tensor) else value for value, placement in zip(flat, placements))
        return model_loss(flat, target)

    return loss

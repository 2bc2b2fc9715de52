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

from autopar.codegen.build import ProgramBuilder, chunk_specs
from autopar.codegen.data_parallel import apply_fsdp, uses_fsdp
from autopar.codegen.interpreter import RunStats
from autopar.codegen.listing import program_listing
from autopar.codegen.parallel_module import ParallelModule
from autopar.codegen.pipeline import PipelineBuilder, tied_weight_groups
from autopar.codegen.program import GraphParts
from autopar.codegen.runtime import agree, build_runtime, ensure_process_group, run_on_rank0
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
                constraints=None, precision: str | None = None) -> ParallelModule:
    """Plan (on rank 0) or take `plan`, and return this rank's ParallelModule."""
    from autopar import api

    _check_arguments(model, example_inputs, plan, global_batch)
    _, world = ensure_process_group()
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = global_batch or _batch_of(inputs)

    def make_plan() -> Plan:
        if plan is not None:
            return plan if isinstance(plan, Plan) else Plan.load(plan)
        return api.plan(model, inputs, cluster or default_cluster(world), global_batch=batch,
                        constraints=constraints, loss_fn=loss_fn, example_targets=example_targets,
                        precision=precision or ("bf16" if torch.cuda.is_available() else "fp32"))

    chosen = run_on_rank0(make_plan)
    if chosen.num_devices != world:
        raise PlanMismatchError(f"this plan is for {chosen.num_devices} devices (mesh {chosen.mesh}), but the job "
                                f"has {world} processes: launch {chosen.num_devices} or re-plan")
    return build_parallel_module(model, inputs, chosen, loss_fn)


def _check_arguments(model, example_inputs, plan, global_batch) -> None:
    """Before joining the process group: a wrong argument fails alike on every rank, at once."""
    from autopar.api import check_model_arguments
    from autopar.validation import check_global_batch, shorten, type_name

    if not isinstance(model, nn.Module) or isinstance(model, type):
        hint = " (build it first, e.g. build_model('gpt').model)" if isinstance(model, str) else ""
        raise ConfigError(f"parallelize takes the model itself, an nn.Module instance, got {type_name(model)} "
                          f"{shorten(model)}{hint}")
    if example_inputs is None:
        raise ConfigError("parallelize needs example_inputs: a tuple of tensors like one global batch")
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


def build_parallel_module(model: nn.Module, inputs: tuple, plan: Plan, loss_fn) -> ParallelModule:
    from autopar.capture import capture_program

    error: AutoparError | None = None
    parts = None
    try:
        program, graph = capture_program(model, inputs, allow_fallback=False)
        plan.check_matches(model_fingerprint=graph.fingerprint(), num_devices=dist.get_world_size(),
                           model_name=type(model).__name__)
        parts = GraphParts.read(program, graph)
    except AutoparError as caught:
        error = caught
    agree(error)
    runtime = build_runtime(plan.mesh)
    stats = RunStats()
    builder = ProgramBuilder(plan, parts, model, runtime.tp_mesh, runtime.device, stats)
    specs = chunk_specs(plan, parts)
    pp, pp_rank = plan.mesh["pp"], runtime.coordinate("pp")
    mine = [spec for spec in specs if spec.index % pp == pp_rank]
    stages = [builder.build(spec, num_chunks=len(specs)) for spec in mine]
    if uses_fsdp(plan.zero_stage, plan.mesh["dp"]):
        apply_fsdp(stages, runtime.dp_mesh, plan.zero_stage)
    schedule, tied = None, {}
    if len(specs) > 1:
        pipeline = PipelineBuilder(plan, parts, builder.placements, runtime.device, runtime.pp_group)
        pipeline_stages = [pipeline.stage(stage, spec, len(specs)) for stage, spec in zip(stages, mine)]
        schedule = pipeline.schedule(pipeline_stages, _pipeline_loss(loss_fn))
        tied = tied_weight_groups(plan, parts, [spec.segments for spec in specs],
                                  (pp, plan.mesh["dp"], plan.mesh["tp"]), runtime.rank)
    coordinate = {axis: runtime.coordinate(axis) for axis in ("pp", "dp", "tp")}
    listing = program_listing(plan, parts, builder.placements, mine, coordinate)
    input_shapes = tuple(tuple(value.shape) if isinstance(value, torch.Tensor) else () for value in inputs)
    return ParallelModule(plan=plan, runtime=runtime, stages=stages, loss_fn=loss_fn, params=builder.params,
                          input_shapes=input_shapes,
                          listing=listing, stats=stats, schedule=schedule, tied_groups=tied,
                          has_first=mine[0].index == 0, has_last=mine[-1].index == len(specs) - 1)


def _pipeline_loss(loss_fn):
    if loss_fn is None:
        return None

    def loss(output, target):
        return loss_fn(output.float() if output.is_floating_point() else output, target)

    return loss

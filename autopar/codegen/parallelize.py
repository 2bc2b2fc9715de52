"""This rank's module for a plan (`build_parallel_module`, the last step of `autopar.parallelize`).

Every rank checks that the plan matches the model (fingerprint of the captured graph), builds the
device mesh, distributes the parameters as the plan places them, shards them over dp (ZeRO) and
sets up the pipeline schedule.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.capture.compute_dtype import COMPUTE_DTYPES
from autopar.codegen import context_parallel, expert_folding
from autopar.codegen.build import ProgramBuilder, chunk_specs
from autopar.codegen.data_parallel import apply_fsdp, reshard_zero3_under_pipelining, uses_fsdp
from autopar.codegen.interpreter import RunStats
from autopar.codegen.listing import program_listing
from autopar.codegen.loss_parallel import ModelLoss
from autopar.codegen.parallel_module import ParallelModule
from autopar.codegen.pipeline import PipelineBuilder, boundary_wires, tied_weight_groups
from autopar.codegen.placements import to_dtensor_placement
from autopar.solver.pipeline import rank_of
from autopar.codegen.program import GraphParts
from autopar.codegen.init import all_names
from autopar.codegen.runtime import agree, build_runtime, factories_on, local_device, register_shutdown
from autopar.errors import AutoparError, ConfigError
from autopar.plans.plan import Plan

def build_parallel_module(model: nn.Module, inputs: tuple, plan: Plan, loss_fn, keywords: dict | None = None, *,
                          captured: tuple | None = None, init_fn=None) -> ParallelModule:
    """This rank's module for `plan`. `captured` is `capture_for_codegen(model, inputs, keywords,
    precision=plan.precision)`'s result when the caller has it already (building the same model for
    several plans); `init_fn` initialises meta-born storage (see `parallelize`)."""
    from autopar.capture.compute_dtype import capture_for_codegen

    keywords = dict(keywords or {})
    cp = plan.mesh.get("cp", 1)
    error: AutoparError | None = None
    parts, seq_len = None, 0
    try:
        program, graph = captured or capture_for_codegen(model, inputs, keywords, precision=plan.precision)
        plan.check_matches(model_fingerprint=graph.fingerprint(), num_devices=dist.get_world_size(),
                           model_name=type(model).__name__)
        if cp > 1:  # the program each rank runs is the model at its share of the sequence
            program, graph, seq_len = context_parallel.local_program(model, inputs, keywords, graph, plan)
        parts = GraphParts.read(program, graph)
    except AutoparError as caught:
        error = caught
    folded = None
    if error is None and expert_folding.folds_experts(plan):
        try:
            folded = _folded_nodes(model, inputs, keywords, parts, plan, local_device())
        except AutoparError as caught:
            error = caught
    agree(error)
    runtime = build_runtime(plan.mesh, ep=plan.ep, folded=folded is not None)
    factories_on(parts.program.graph, runtime.device)
    stats = RunStats()
    builder = ProgramBuilder(plan, parts, model, runtime.tp_mesh, runtime.device, stats)
    if plan.ep > 1:
        builder.use_expert_parallelism(runtime, folded=folded is not None)
    if folded is not None:
        builder.interpreter.folded = expert_folding.FoldedRegions(folded, builder.placements, runtime.tp_mesh,
                                                                  builder.interpreter.experts)
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
        if builder.fp8 is not None:  # float8 all-gathers: the weights become torchao's FSDP2 extension first
            builder.fp8.wrap_for_fsdp([module for stage in stages for module in stage.modules()], builder.params)
            builder.weight_casts.before_step.append(builder.fp8.precompute_scales)
        apply_fsdp(stages, runtime.reduce_mesh, plan.zero_stage, offload=plan.offload,
                   param_dtype=COMPUTE_DTYPES.get(plan.precision),
                   expert_mesh=runtime.expert_replica_mesh if plan.ep > 1 else None,
                   root_ends=plan.fsdp_root_ends)
        if len(specs) > 1 and plan.zero_stage == 3:
            reshard_zero3_under_pipelining(stages)
        builder.fuse_under_fsdp(stages)
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
    _use_random_ops(module, parts, runtime)
    module.parameter_aliases = {first: names[1:] for first, names in all_names(model).items() if len(names) > 1}
    _initialise(module, model, builder, init_fn)
    register_shutdown()
    return module


def _use_random_ops(module: ParallelModule, parts: GraphParts, runtime) -> None:
    """Name the program's random ops; with tp > 1, keep the tp group's generators equal
    (codegen/random_ops.py: every tp rank draws what one process draws)."""
    from autopar.codegen.random_ops import GeneratorSync, random_nodes

    found = set(random_nodes(parts.program.graph))
    module.random_ops = tuple(str(node.target) for node in parts.program.graph.nodes if node.name in found)
    if module.random_ops and runtime.tp_mesh.size() > 1:
        module.random_sync = GeneratorSync(runtime.tp_mesh.get_group(), runtime.device)


def _folded_nodes(model, inputs: tuple, keywords: dict, parts: GraphParts, plan: Plan, device: torch.device) -> dict:
    """The MoE layers' region nodes of the model exported at each tp rank's tokens (codegen/expert_folding.py)."""
    from autopar.solver.context_parallel import sequence_length

    blocker = expert_folding.folding_blocker(plan)
    if blocker:
        raise ConfigError(blocker)
    region = expert_folding.region_of(parts.graph)
    return expert_folding.local_nodes(model, inputs, keywords, sequence_length(parts.graph), plan.mesh["tp"], region,
                                      parts.program, device, precision=plan.precision)


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

"""Data parallelism and ZeRO on the dp axis, composed with tensor parallelism.

    ZeRO 0  parameters replicated; gradients all-reduced (averaged) over dp once per step
    ZeRO 1  FSDP2 fully_shard, parameters gathered once per step and kept until the last
            microbatch's backward (set_reshard_after_backward), gradient reduce-scatter only
            after the last microbatch (set_requires_gradient_sync); FSDP2 accumulates the
            gradients unsharded in fp32 meanwhile, where the linears' GEMMs add into it
            (codegen/fused_wgrad.py, also under ZeRO 2 with pipelining)
    ZeRO 2  as 1, but gradients reduce-scattered after every microbatch (without pipelining)
    ZeRO 3  FSDP2 with reshard_after_forward: parameters gathered before each use
    offload ZeRO 3 with CPUOffloadPolicy (ZeRO-Offload as FSDP2 runs it): sharded parameters,
            gradients and optimizer states in host memory, copied to the device before each
            all-gather and back after each reduce-scatter; the optimizer the user builds over
            these parameters steps on the CPU. Also with dp = 1 (FSDP2 over one device). On CPU
            devices (gloo) the copies are CPU-to-CPU and pinning is off (it needs an
            accelerator): the code path runs, and frees nothing, as the host is the device.

Every segment module (a transformer block) is one FSDP unit, the stage program the root unit
for parameters shared by several segments, as torchtitan shards a model: the parameters are
already tensor-parallel DTensors on the tp dimension of the same device mesh. Where the plan says
so (Plan.fsdp_root_ends: one stage, small ends), the first and last segments are the root's too.

A weight that several of one rank's pipeline chunks read (a tied embedding and head under ZB-V,
T5's shared embedding interleaved) is one Parameter of several stage programs. FSDP2 shards per
fully_shard call, so each stage would get its own sharded copy: two weights, each with part of
the gradient, updated apart. Such weights are left whole (`ignored_params`): autograd sums their
gradient over the chunks, and ParallelModule averages it over dp with an all-reduce, as under
ZeRO 0 (their parameters, gradients and optimizer states are replicated over dp, not sharded).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from autopar.codegen.program import ExpertWeights, StageProgram, shared_parameters


def uses_fsdp(zero_stage: int, dp: int, offload: bool = False) -> bool:
    """Whether FSDP2 shards the parameters (`dp`: the data shards, dp x cp); the planner prices
    the same rule (solver/step_tail.py's uses_fsdp, which may not import codegen)."""
    return offload or (zero_stage >= 1 and dp > 1)


def apply_fsdp(stages: list[StageProgram], dp_mesh, zero_stage: int, *, offload: bool = False,
               param_dtype: torch.dtype | None = None, expert_mesh=None, root_ends: bool = False) -> None:
    """`param_dtype` (mixed precision): FSDP2 casts each fp32 shard to it before the all-gather,
    so the gathered parameters the segments use are already in the compute dtype (one cast per
    gather, on the shard), and reduce-scatters the gradients in fp32, as torchtitan's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does. Forward inputs are left as
    they are: the stage programs cast what the plan computes in bf16 (program.py).

    `expert_mesh` (expert parallelism): the dp_rep ranks that hold the same experts. Each
    segment's expert weights (its ExpertWeights child) are one FSDP unit over that mesh, sharded
    along a dim expert parallelism and tensor parallelism leave whole (`expert_shard_dim`), their
    gradients reduce-scattered (averaged) over dp_rep only, then divided by ep
    (`divide_expert_gradients`: each expert gradient already sums the tokens of the ep ranks of
    its group); the rest of the segment is
    sharded over all dp ranks, as torchtitan shards a MoE block (its "efsdp" mesh).

    `root_ends` (Plan.fsdp_root_ends, one stage): the first and last segments are not units of
    their own, so their parameters are the root unit's (the stage's), and the last block is not
    resharded after forward, as the plan was priced (cost_model/fsdp.py's "root ends")."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    reshard = zero_stage == 3
    policy = OffloadPolicy()
    if offload:
        if zero_stage != 3:
            from autopar.errors import PlanMismatchError

            raise PlanMismatchError(f"the plan asks for optimizer offload with zero_stage={zero_stage}; offload runs "
                                    "with ZeRO-3 only: re-plan (autopar plan picks ZeRO-3 for offload)")
        policy = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                                     cast_forward_inputs=False)
    whole = {id(param): param for param in shared_parameters(stages)}
    options = dict(mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy, mp_policy=precision,
                   ignored_params=set(whole.values()))
    for stage in stages:
        ends = root_ends and len(stages) == 1 and len(stage.segments) >= 3
        last = len(stage.segments) - 1
        for index, segment in enumerate(stage.segments):
            if expert_mesh is not None and segment.has_experts:
                _shard_experts(segment.experts, expert_mesh, options, fully_shard)
            if ends and index in (0, last):
                continue  # the root's
            if any(id(param) not in whole for param in segment.parameters(recurse=False)):
                kept = ends and index == last - 1  # the last block, gathered until its backward
                fully_shard(segment, **(dict(options, reshard_after_forward=False) if kept else options))
        fully_shard(stage, **options)


def _shard_experts(experts: ExpertWeights, expert_mesh, options: dict, fully_shard) -> None:
    """FSDP2 averages the expert gradients over dp_rep; ParallelModule divides them by ep after
    (`divide_expert_gradients`)."""
    replicas = expert_mesh.size()
    fully_shard(experts, **{**options, "mesh": expert_mesh, "ignored_params": None},
                shard_placement_fn=lambda param: Shard(expert_shard_dim(param, replicas)))


def divide_expert_gradients(parameters: list[nn.Parameter], divisor: float) -> None:
    """Under FSDP, after its reduce-scatter over the dp_rep ranks holding the same experts (an
    average over dp_rep): the average over all dp = dp_rep x ep ranks (`divisor` = ep), as every
    expert gradient already sums the tokens of the ep ranks of its group (their all-to-all's
    backward). Folded (etp=1), dp_rep = dp x tp / ep: `divisor` = ep / tp
    (codegen/expert_folding.expert_gradient_divisor)."""
    for param in parameters:
        if param.grad is not None and divisor != 1:
            param.grad.div_(divisor)


def expert_shard_dim(param: torch.Tensor, replicas: int) -> int:
    """The dim FSDP2 shards an expert weight [E, ..] along: its largest dim after the expert dim
    that tensor parallelism leaves whole (expert parallelism splits dim 0) and that splits evenly
    over the `replicas` (FSDP2 shards other dims than 0 evenly only), so the FSDP shards do not
    interleave with the ep/tp blocks; dim 0 (strided, padded) when none is left."""
    split = {placement.dim for placement in getattr(param, "placements", ()) if isinstance(placement, Shard)}
    local = param.to_local().shape if isinstance(param, DTensor) else param.shape
    free = [dim for dim in range(1, param.dim()) if dim not in split and local[dim] % replicas == 0]
    return max(free, key=lambda dim: local[dim]) if free else 0


def set_gradient_sync(stages: list[StageProgram], enabled: bool) -> None:
    for stage in stages:
        if hasattr(stage, "set_requires_gradient_sync"):
            stage.set_requires_gradient_sync(enabled)


def set_reshard_after_backward(stages: list[StageProgram], enabled: bool) -> None:
    """ZeRO-1/2 keep parameters gathered from the first microbatch's forward to the last one's
    backward (one all-gather per step, as torch.distributed.pipelining does under FSDP2)."""
    for stage in stages:
        if hasattr(stage, "set_reshard_after_backward"):
            stage.set_reshard_after_backward(enabled)


def reshard_zero3_under_pipelining(stages: list[StageProgram]) -> None:
    """ZeRO-3 stays ZeRO-3 under torch.distributed.pipelining: each unit resharded after every
    backward, as planned (the plan prices one unit gathered at a time and two all-gathers per unit
    and microbatch, solver/step_fsdp.py).

    Before every microbatch's backward but the last, PipelineStage.backward_maybe_with_nosync sets
    reshard_after_backward False on its stage's FSDP modules (recursively), for ZeRO-1/2's sake. Under
    ZeRO-3 that leaves each unit gathered from its backward to its next forward: after a backward
    every unit of the stage at once, ZeRO-2's memory with more all-gathers (measured on gloo, pp=2 x
    dp=2, 4 microbatches: all 3 units of a rank gathered at once, 15 all-gathers a step). So the
    stage's setter keeps the flag True; the schedule's last backward sets True anyway."""
    for stage in stages:
        if hasattr(stage, "set_reshard_after_backward"):
            stage.set_reshard_after_backward = functools.partial(_reshard_always, stage.set_reshard_after_backward)


def _reshard_always(setter, reshard_after_backward: bool, *, recurse: bool = True) -> None:
    setter(True, recurse=recurse)


def all_reduce_gradients(parameters: list[nn.Parameter], group, size: int) -> None:
    """ZeRO 0: sum each gradient's local shard over `group` and divide by `size` (the dp degree:
    the group is the dp group, or for expert weights the dp ranks holding the same experts)."""
    if size <= 1:
        return
    for param in parameters:
        if param.grad is None:
            continue
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, group=group)
        local.div_(size)


def sum_over_group(value: torch.Tensor, group) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value


@torch.no_grad()
def reduce_partial_gradients(params) -> None:
    """Sum the gradients DTensor left as pending sums over the tensor-parallel mesh.

    A replicated weight read by an op whose work is split (a norm over sequence-sharded
    activations, a bias after a row-parallel matmul) gets a Partial gradient: each device holds
    its tokens' share. DTensor would reduce it only when something reads it (the optimizer's
    update, `full_tensor`), after the step. It is reduced here, once per step, so the step leaves
    finished gradients (as FSDP2 leaves its own: it reduces them before its reduce-scatter) and
    the optimizer, clipping and the user's code read whole values. The planner prices these
    reductions once per step too (solver/prepared.once_per_step: "tp.grad_reduce.once")."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) \
                and any(isinstance(placement, Partial) for placement in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)

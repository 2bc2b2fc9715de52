"""The step model's terms outside the pipeline (solver/step_model.py): the data-parallel
synchronisation after it, the optimizer step (on the device, or on the host under offload), the
tied weights' sync, and autopar's runtime's own per-step terms (the bf16 weight copies made when
the step starts, gradient accumulation over microbatches). Each is priced per pipeline stage; the
step takes the slowest stage's (StepModel.assemble).
"""

from __future__ import annotations

from autopar.mesh import Mesh
from autopar.solver.configs import ZERO_BUBBLE_SCHEDULES, ParallelConfig, StageEstimate
from cost_model.comm import Group
from cost_model.contention import sm_share


def uses_fsdp(config: ParallelConfig) -> bool:
    """Whether the runtime shards with FSDP2 (codegen/data_parallel.py's uses_fsdp): ZeRO-1 and
    up over more than one data shard, and optimizer offload even at dp = 1."""
    return config.offload or (config.zero_stage >= 1 and config.data_shards > 1)


def fsdp_fuses_wgrad(*, zero_stage: int, pp: int, num_microbatches: int, offload: bool) -> bool:
    """Under FSDP2, whether the runtime accumulates weight gradients inside their GEMMs
    (codegen/fused_wgrad.py): where FSDP2 keeps an fp32 unsharded gradient across microbatches
    (FSDPParam.unsharded_accumulated_grad: ZeRO-1, and ZeRO-2 under pipelining, which reduce-scatter
    after the last microbatch only), the GEMM writes into it. Not ZeRO-2 without pipelining (each
    microbatch's bf16 gradient goes straight to the reduce-scatter, cast in its copy-in), not one
    microbatch (nothing accumulates), not ZeRO-3 or offload (left as FSDP2 runs them)."""
    return zero_stage in (1, 2) and not offload and num_microbatches > 1 and (zero_stage == 1 or pp > 1)


def sharded_numel(stage: StageEstimate, config: ParallelConfig) -> float:
    """Parameters of the stage in this device's optimizer shard: all of them under ZeRO-0, else
    the dense ones over the data shards and this rank's experts over the ranks holding the same
    experts (data shards / ep, folded x tp: ParallelConfig.expert_data_shards)."""
    if config.zero_stage == 0:
        return stage.param_numel
    experts = stage.expert_param_numel
    return (stage.param_numel - experts) / config.data_shards + experts / config.expert_data_shards


def tp_group(config: ParallelConfig, devices_per_node: int) -> Group:
    """The tp ranks of a stage: consecutive, innermost in the (pp, dp x cp, tp) layout."""
    return Mesh(axis_names=("pp", "dp_cp", "tp"), shape=(config.pp, config.data_shards, config.tp),
                devices_per_node=devices_per_node).group(2)


def replica_group(dp_rep: int, ep: int, cp: int, tp: int, devices_per_node: int) -> Group:
    """The dp_rep x cp ranks of the (dp_rep, ep, cp, tp) layout that share an (ep, tp) index:
    how many nodes they span and how many sit in one node."""
    cp_group = Mesh(axis_names=("cp", "tp"), shape=(cp, tp), devices_per_node=devices_per_node).group(0)
    rep_group = Mesh(axis_names=("dp_rep", "ep", "cp", "tp"), shape=(dp_rep, ep, cp, tp),
                     devices_per_node=devices_per_node).group(0)
    if cp_group.num_nodes > 1:  # the cp ranks already span nodes: each dp_rep rank on other nodes
        return Group(num_nodes=cp_group.num_nodes * dp_rep, devices_per_node=cp_group.devices_per_node)
    return Group(num_nodes=rep_group.num_nodes, devices_per_node=rep_group.devices_per_node * cp)


class StepTail:
    """StepModel's per-step terms (a mixin: the figures they read are StepModel's fields)."""

    def comm_sm_share(self) -> float:
        """Share of the SMs a collective holds while it runs beside compute (cost_model/contention.py;
        0: the library's channels or the device's SMs unknown)."""
        channels = self.comm.collectives.channels if self.comm.collectives is not None else 0
        return sm_share(channels, self.compute.device.sm_count)

    @property
    def optimizer_io_bytes_per_param(self) -> float:
        """Bytes one optimizer step moves per parameter (the precision policy's implementation)."""
        return self.policy.optimizer_io_bytes_per_param

    def _cpu_adam_s(self, stage: StageEstimate, config: ParallelConfig) -> float:
        """The optimizer step on the CPU over this device's shard, memory-bound like the device's."""
        numel = stage.param_numel / config.data_shards
        return numel * self.optimizer_io_bytes_per_param / self.host_memory_bandwidth_bytes_per_s

    def _offload_notes(self, stage: StageEstimate, config: ParallelConfig) -> tuple[str, ...]:
        if not config.offload:
            return ()
        host = sum(stage.host_memory_bytes.values())
        rate = self.host_memory_bandwidth_bytes_per_s / self.optimizer_io_bytes_per_param
        return (f"optimizer offload (FSDP2 CPUOffloadPolicy): {host / 2**30:.3g} GiB of parameters, gradients and "
                f"Adam states per device in host memory ({self.host_memory_bytes / 2**30:.3g} GiB per device); "
                f"host link {self.host_link_bytes_per_s / 1e9:.3g} GB/s, CPU Adam "
                f"{rate / 1e9:.3g} G parameters/s",)

    def _data_shard_group(self, config: ParallelConfig):
        """The ranks that reduce gradients (and FSDP shards over): dp x cp, cp inside dp in the
        (pp, dp, cp, tp) layout, so one flattened axis."""
        key = (config.pp, config.data_shards, config.tp)
        if key not in self._group_cache:
            mesh = Mesh(axis_names=("pp", "dp_cp", "tp"), shape=key, devices_per_node=self.devices_per_node)
            self._group_cache[key] = mesh.group(1)
        return self._group_cache[key]

    def expert_replica_group(self, config: ParallelConfig) -> Group:
        """The ranks holding the same experts, over which expert gradients are reduced (and FSDP
        shards expert weights): the dp_rep x cp ranks of the (pp, dp_rep, ep, cp, tp) layout
        (codegen/runtime.py), dp_rep strided by ep x cp x tp, cp by tp."""
        key = ("experts", config.pp, config.dp, config.ep, config.cp, config.tp, config.folds_experts)
        if key not in self._group_cache and config.folds_experts:  # (cp = 1) the tp x dp / ep ranks of an ep slot
            self._group_cache[key] = Mesh(axis_names=("pp", "rep", "ep"), shape=(config.pp, config.expert_data_shards,
                                                                                 config.ep),
                                          devices_per_node=self.devices_per_node).group(1)
        if key not in self._group_cache:
            self._group_cache[key] = replica_group(config.dp // config.ep, config.ep, config.cp, config.tp,
                                                   self.devices_per_node)
        return self._group_cache[key]

    def _dp_group_time(self, op: str, message_bytes: float, config: ParallelConfig) -> float:
        return self.comm.time_s(op, message_bytes, self._data_shard_group(config))

    def _dp_sync_exposed_s(self, stage: StageEstimate, config: ParallelConfig) -> float:
        """Synchronisation after the pipeline: ZeRO-1's last reduce-scatter (ZeRO-2/3 are inside
        each microbatch's stage time); ZeRO-0's all-reduce, issued bucket by bucket inside the
        last backward (codegen/grad_overlap.py), exposed where it outlasts that backward, and at
        least its last bucket (its hidden part still holds the SMs NCCL runs on). Under the
        zero-bubble schedules torch's weight pass adds the weight gradients by hand, which reports
        no completed gradient: reduced after the step."""
        if config.data_shards <= 1:
            return 0.0
        if config.zero_stage >= 1:
            return sum(stage.fsdp_step_end_s.values())
        grad_bytes = (stage.param_numel - stage.expert_param_numel) * self.policy.dp_reduce_bytes
        num_buckets = max(1, len(stage.segment_names))
        backward_one = stage.backward_s + stage.recompute_s
        sync = self._dp_group_time("all_reduce", grad_bytes, config)
        if stage.expert_param_numel and config.expert_data_shards > 1:
            # Expert gradients are complete within the expert group: reduced over the dp / ep
            # (x cp) ranks that hold the same experts.
            sync += self.comm.time_s("all_reduce", stage.expert_param_numel * self.policy.dp_reduce_bytes,
                                     self.expert_replica_group(config))
        if config.schedule in ZERO_BUBBLE_SCHEDULES:
            return sync
        exposed = max(sync - backward_one, sync / num_buckets)
        # The hidden part still holds the collective's SMs while the backward runs
        # (cost_model/contention.py).
        return exposed + (sync - exposed) * self.comm_sm_share()

    def _optimizer_s(self, stage: StageEstimate, config: ParallelConfig) -> float:
        return sharded_numel(stage, config) * self.optimizer_io_bytes_per_param / self.compute.bandwidth_bytes_per_s

    def _weight_cast_s(self, stage: StageEstimate, config: ParallelConfig) -> float:
        """The step's bf16 copies of the weights (PrecisionPolicy.casts_once_per_step), made when
        the step starts, before the first forward: exposed on the first pipeline rank, and priced
        on every rank alike (an upper bound: a later rank's cast overlaps its wait for the first
        microbatch). Under FSDP2 the cast is on the shard, in the all-gather's copy-in stream."""
        if not self.policy.casts_once_per_step or uses_fsdp(config):
            return 0.0
        cast_bytes = stage.param_numel * (self.policy.master_bytes + self.policy.param_bytes)
        return cast_bytes / self.compute.bandwidth_bytes_per_s

    def _gradient_accumulate_s(self, stage: StageEstimate, config: ParallelConfig) -> float:
        """Gradient accumulation over microbatches in autopar's runtime (casts_once_per_step), from
        the second microbatch on. Without FSDP the step's bf16 copy adds each weight gradient into
        the fp32 .grad in one kernel (codegen/main_grad.py: reads bf16 and fp32, writes fp32, 10
        bytes): 4 more than the cast already priced per microbatch (evaluate._add_gradient_cast);
        under the zero-bubble schedules torch's weight pass casts and adds itself (autograd's cast,
        then a separate add reading two fp32 tensors and writing one, 12 bytes). Under FSDP2
        without a reduce-scatter per microbatch its fused add of the bf16 gradient into the fp32
        accumulator is 4 bytes more than the cast; with a reduce-scatter per microbatch only the
        shard accumulates. Weights whose gradients accumulate inside their GEMMs (StageEstimate.
        fused_wgrad_numel: CUDA, no zero-bubble schedule, under FSDP2 where fsdp_fuses_wgrad) add
        nothing, as under Megatron-LM's gradient-accumulation fusion (not priced: MEGATRON_BF16)."""
        m = config.num_microbatches
        if not self.policy.casts_once_per_step or m <= 1 or config.offload:  # offload: on the host (offload.*)
            return 0.0
        master = self.policy.master_bytes
        if not uses_fsdp(config):
            bytes_per_param = 3 * master if config.schedule in ZERO_BUBBLE_SCHEDULES else master
        elif config.zero_stage >= 2 and config.pp == 1:  # only the shard accumulates
            return (m - 1) * sharded_numel(stage, config) * 3 * master / self.compute.bandwidth_bytes_per_s
        else:  # reads fp32 and bf16, writes fp32 (10 bytes): 4 more than the cast's 6
            bytes_per_param = master
        numel = stage.param_numel - stage.fused_wgrad_numel
        return (m - 1) * numel * bytes_per_param / self.compute.bandwidth_bytes_per_s

    def _tied_sync_s(self, config: ParallelConfig, stages) -> float:
        """The shared weights' gradients summed over the pipeline ranks holding a copy, after the
        step: per weight and extra rank, a send and a receive of its gradient (an exchange, for
        the two ranks of a tied embedding and head)."""
        if config.pp <= 1:
            return 0.0
        crosses = config.data_shards * config.tp * (config.pp - 1) >= self.devices_per_node
        total = 0.0
        for index, (numel, _) in enumerate(self.shared_params):
            ranks = sum(1 for stage in stages if index < len(stage.shared_held) and stage.shared_held[index])
            if ranks > 1:
                total += (ranks - 1) * 2 * self.comm.send_recv_s(numel / config.tp * self.policy.grad_bytes,
                                                                  crosses_nodes=crosses)
        return total
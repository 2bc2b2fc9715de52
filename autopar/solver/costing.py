"""Prices of one op under one sharding strategy, and of resharding a tensor between placements.

Compute: the op's forward and backward kernels (counted on meta at capture) with FLOPs divided
by the devices the work is split over and bytes scaled by the sharded input + output size; a
grouped expert matmul is priced as its device's experts' matmuls, each of its own size.
Resharding: DTensor redistributes one mesh axis at a time; each axis' collective moves the
tensor's bytes divided by the shards of the other axes that stay sharded.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.graph import Kernel, OpNode, TensorMeta
from autopar.mesh import Mesh
from autopar.strategies import Strategy
from autopar.strategies.grouped_mm import GROUPED_MM_TARGETS
from autopar.strategies.placement import PARTIAL, is_shard, shard_dim, shard_factor, shards_on_dim, transition
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel, ComputeTime
from cost_model.memory import BF16_ADAM, PrecisionPolicy


IMPOSSIBLE_S = math.inf
"""Price of a resharding the runtime cannot do: the ILP excludes the choice."""


@dataclass(frozen=True)
class CommEvent:
    """One collective: which, on which mesh axis, how many bytes, how long, forward or backward."""

    op: str
    axis: int
    message_bytes: float
    time_s: float
    phase: str
    """"fwd", "bwd" or "step" (once per optimizer step: gradient synchronisation)."""
    summed: bool = False
    """Reduces a gradient autograd summed over several readers of one redistributed tensor (the
    backward of a fan-out), not the output of one op."""
    copy_s: float = 0.0
    """Of time_s: the runtime's copy of the tensor into or out of the collective's dim-0 layout
    (PrecisionPolicy.sp_layout_copies), compute-stream work priced as its own term (tp.layout_copy.gather, tp.layout_copy.scatter)."""
    unfused_copy_s: float | None = None
    """Under tensor-parallel overlap (PrecisionPolicy.tp_comm_overlap), the layout copy the
    collective takes where the runtime does not fuse it with a GEMM (it keeps DTensor's path).
    None: no overlap. copy_s is 0 then until tp_windows.with_windows knows which it is."""
    fused_pass_s: float = 0.0
    """Under tensor-parallel overlap, the fused kernel's own memory pass (tp_overlap_passes)."""
    window: tuple[tuple[str, float], ...] | None = None
    """The GEMMs a tensor-parallel overlap can run this collective beside, with their seconds
    (its linear's: solver/tp_windows.py); None: not recorded (no cap)."""

    @property
    def column(self) -> str:
        """Its term in the breakdown: the op, and ".summed" for a summed gradient's reduce-scatter
        (which torch's async TP cannot fuse with a GEMM: solver/tp_overlap.py)."""
        return f"{self.op}.summed" if self.summed and self.op == "reduce_scatter" else self.op


@dataclass
class CostContext:
    """Everything needed to price ops on a mesh of a cluster."""

    mesh: Mesh
    compute: ComputeModel
    comm: CommModel
    policy: PrecisionPolicy = BF16_ADAM
    fused_wgrad: bool = False
    """The runtime can accumulate a linear's weight gradient into the fp32 .grad inside its GEMM
    (codegen/fused_wgrad.py: CUDA's out_dtype matmul; not on CPU clusters)."""
    math_attention: bool = False
    """The runtime runs fused attention as torch's math kernel (on CPU DTensors, under tensor
    parallelism: codegen/interpreter.py's `_cpu_attention`): priced as that path's kernels
    (OpNode.unfused_fwd_kernels / unfused_bwd_kernels), not the fused kernel's."""
    _redistribute_cache: dict = field(default_factory=dict)
    _compute_cache: dict = field(default_factory=dict)

    def node_compute(self, node: OpNode, strategy: Strategy, inputs: Sequence[TensorMeta]) -> tuple[ComputeTime, ComputeTime]:
        """(forward, backward) time of `node` under `strategy`."""
        key = (node.name, strategy)
        cached = self._compute_cache.get(key)
        if cached is not None:
            return cached
        divisor = strategy.work_divisor(self.mesh.shape)
        bytes_scale = self._bytes_scale(node, strategy, inputs)
        groups = self.local_experts(node, strategy, inputs)
        fwd_kernels, bwd_kernels = node.fwd_kernels, node.bwd_kernels
        if self.math_attention and node.unfused_fwd_kernels:
            fwd_kernels, bwd_kernels = node.unfused_fwd_kernels, node.unfused_bwd_kernels
        forward = self.compute.kernels(fwd_kernels, flops_scale=1.0 / divisor, bytes_scale=bytes_scale, groups=groups)
        backward = self.compute.kernels(bwd_kernels, flops_scale=1.0 / divisor, bytes_scale=bytes_scale, groups=groups)
        self._compute_cache[key] = (forward, backward)
        return forward, backward

    def fused_epilogue(self, node: OpNode, strategy: Strategy, inputs: Sequence[TensorMeta],
                       weight_numel: float) -> ComputeTime:
        """What a linear's weight-gradient GEMM costs more when its epilogue accumulates into the
        fp32 gradient (cuBLAS with fp32 C and D, beta = 1: reads 4 and writes 4 bytes per weight
        element where the plain GEMM writes 2 in bf16): its kernel priced by the roofline with
        those bytes added, less the kernel as captured (zero while the GEMM stays compute-bound).
        `weight_numel`: this device's elements of the weight."""
        matmuls = [kernel for kernel in node.bwd_kernels if kernel.is_matmul]
        if not matmuls:
            return ComputeTime()
        kernel = max(matmuls, key=lambda item: item.flops)  # dX and dW: the same FLOPs and bytes
        flops = kernel.flops / strategy.work_divisor(self.mesh.shape)
        io_bytes = kernel.io_bytes * self._bytes_scale(node, strategy, inputs)
        extra = weight_numel * (2 * self.policy.master_bytes - self.policy.param_bytes)
        plain = self.compute.kernel(flops, io_bytes, True, dtype=kernel.dtype, name=kernel.name)
        fused = self.compute.kernel(flops, io_bytes + extra, True, dtype=kernel.dtype, name=kernel.name)
        return ComputeTime(matmul_s=fused.matmul_s - plain.matmul_s, memory_s=fused.memory_s - plain.memory_s)

    def grouped_bytes(self, node: OpNode, strategy: Strategy, inputs: Sequence[TensorMeta], kernel: Kernel,
                      weight: Sequence[str]) -> dict[str, float]:
        """A grouped-matmul kernel's bytes on one device as node_compute prices them (io_bytes)
        and of those its per-expert operands' (expert_bytes: Kernel.expert_bytes over the weight's
        placement `weight`)."""
        io_bytes = kernel.io_bytes * self._bytes_scale(node, strategy, inputs)
        expert_bytes = kernel.expert_bytes / shard_factor(weight, self.mesh.shape)
        return {"io_bytes": io_bytes, "expert_bytes": min(expert_bytes, io_bytes)}

    def _bytes_scale(self, node: OpNode, strategy: Strategy, inputs: Sequence[TensorMeta]) -> float:
        full_bytes = sum(meta.nbytes for meta in inputs) + sum(meta.nbytes for meta in node.outputs)
        local_bytes = sum(meta.nbytes / shard_factor(placements, self.mesh.shape)
                          for meta, placements in zip(inputs, strategy.inputs))
        local_bytes += sum(meta.nbytes / shard_factor(strategy.output, self.mesh.shape) for meta in node.outputs)
        return local_bytes / full_bytes if full_bytes else 1.0 / strategy.work_divisor(self.mesh.shape)

    def local_experts(self, node: OpNode, strategy: Strategy, inputs: Sequence[TensorMeta]) -> int:
        """Experts a grouped matmul (tokens[S, K], weight[E, K, N], offs) runs on one device: E over
        the mesh axes that shard the weight by expert (1 for any other op)."""
        if node.target not in GROUPED_MM_TARGETS or len(inputs) < 2 or len(inputs[1].shape) != 3:
            return 1
        shards = math.prod(size for size, placement in zip(self.mesh.shape, strategy.inputs[1]) if placement == "S0")
        return max(inputs[1].shape[0] // shards, 1)

    def redistribute(self, meta: TensorMeta, source: Sequence[str], target: Sequence[str], phase: str) -> tuple[CommEvent, ...]:
        """Collectives that turn a tensor with per-axis placements `source` into `target`."""
        key = (meta.shape, meta.dtype, tuple(source), tuple(target), phase)
        cached = self._redistribute_cache.get(key)
        if cached is not None:
            return cached
        events = []
        for axis, (src, dst) in enumerate(zip(source, target)):
            if dst == PARTIAL and src != PARTIAL and phase == "fwd":
                # DTensor only makes Partial values inside an op's rule, never by redistribution.
                events.append(CommEvent(op="impossible", axis=axis, message_bytes=0.0, time_s=IMPOSSIBLE_S, phase=phase))
                continue
            op = transition(src, dst)
            if op is None:
                continue
            bytes_on_axis = meta.nbytes / self._other_shards(source, target, axis)
            axis_size = self.mesh.shape[axis]
            message = bytes_on_axis / axis_size if op == "all_to_all" else bytes_on_axis
            time_s = self.comm.time_s(op, message, self.mesh.group(axis))
            copy_s = self._layout_copy_s(meta, source, op, src if op == "all_gather" else dst, bytes_on_axis)
            unfused, fused = None, 0.0
            if self.policy.tp_comm_overlap and op in ("all_gather", "reduce_scatter"):
                unfused, fused, copy_s = copy_s, self._fused_pass_s(op, bytes_on_axis, axis_size), 0.0
            events.append(CommEvent(op=op, axis=axis, message_bytes=message, time_s=time_s + copy_s, phase=phase,
                                    copy_s=copy_s, unfused_copy_s=unfused, fused_pass_s=fused))
        result = tuple(events)
        self._redistribute_cache[key] = result
        return result

    def _fused_pass_s(self, op: str, full_bytes: float, axis_size: int) -> float:
        """The memory pass a fused kernel adds (PrecisionPolicy.tp_overlap_passes): an all-gather's
        copy of the local shard into the symmetric buffer, a reduce-scatter's sum of the tp partial
        outputs into the shard; none without those passes."""
        if not self.policy.tp_overlap_passes:
            return 0.0
        shard = full_bytes / axis_size
        moved = 2 * shard if op == "all_gather" else full_bytes + shard
        return moved / self.compute.bandwidth_bytes_per_s + self.compute.overhead_s

    def _layout_copy_s(self, meta: TensorMeta, source: Sequence[str], op: str, sharded: str,
                       full_bytes: float) -> float:
        """The copy of a gathered (or to be scattered) tensor of `full_bytes` into place, where the
        collective's dim is not 0 (PrecisionPolicy.sp_layout_copies): a read and a write. Collectives
        fused with their GEMMs (tp_comm_overlap: torch's async TP, TE's userbuffers) move their
        chunks in the fused kernels instead (`redistribute` keeps this as CommEvent.unfused_copy_s)."""
        mode = self.policy.sp_layout_copies
        if mode == "none" or op not in ("all_gather", "reduce_scatter") or not is_shard(sharded):
            return 0.0
        dim = shard_dim(sharded)
        if dim == 0:
            return 0.0
        if op == "all_gather" and mode == "batched_gathers":
            leading = math.prod(meta.shape[index] / shards_on_dim(source, index, self.mesh.shape) for index in range(dim))
            if leading <= 1:
                return 0.0
        return 2 * full_bytes / self.compute.bandwidth_bytes_per_s + self.compute.overhead_s

    def op_collectives(self, strategy: Strategy) -> tuple[CommEvent, ...]:
        """The collectives `strategy`'s own rule runs (Strategy.collectives); a message shrinks with
        the other axes the op's work is split over."""
        events = []
        for op, axis, phase, message_bytes in strategy.collectives:
            others = math.prod(size for other, (size, split) in enumerate(zip(self.mesh.shape, strategy.split_axes))
                               if split and other != axis)
            time_s = self.comm.time_s(op, message_bytes / others, self.mesh.group(axis))
            events.append(CommEvent(op=op, axis=axis, message_bytes=message_bytes / others, time_s=time_s, phase=phase))
        return tuple(events)

    def _other_shards(self, source: Sequence[str], target: Sequence[str], axis: int) -> int:
        divisor = 1
        for other, (src, dst) in enumerate(zip(source, target)):
            if other != axis and is_shard(src) and src == dst:
                divisor *= self.mesh.shape[other]
        return divisor

    def optimizer_step_s(self, numel: float) -> float:
        """Adam update of `numel` parameters (memory-bound; the policy's implementation)."""
        return numel * self.policy.optimizer_io_bytes_per_param / self.compute.bandwidth_bytes_per_s

    def param_state_bytes(self, numel: float) -> float:
        return numel * self.policy.model_state_bytes


def total_time(events: Sequence[CommEvent]) -> float:
    return sum(event.time_s for event in events)

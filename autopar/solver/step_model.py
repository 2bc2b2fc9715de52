"""Step time and memory of a full configuration (pp x dp x tp, microbatching, schedule,
recomputation, ZeRO) from the per-segment costs of the intra-op solution.

Per segment, for one microbatch on one device of a tensor-parallel group:
    f = forward compute + forward tensor-parallel collectives
    b = backward compute + backward collectives
    r = recompute (modes in recompute.py): none 0 | gathers: the backward all-gathers of saves kept
        sequence-sharded | selective: parameter-free ops' forward (+ those all-gathers) | op: the
        forward of all but the kept matmuls and attention, and its all-gathers | full: f
    a = activations kept: none: all saved | gathers: gathered saves as shards | selective, op:
        see evaluate.py and recompute.py | full: the segment's input
Stage k holds segments S_k:  t_k = sum_{S_k} (f + b + r) + p2p_k, where p2p_k sends the stage's
output forward and receives its gradient back (x v for interleaving).

Pipeline with m microbatches on p stages (Narayanan et al., SC21; Qi et al., "Zero Bubble
Pipeline Parallelism", 2023, for the zero-bubble schedules, whose backward runs as an input-
gradient pass B_k and a weight-gradient pass W_k; t_k = F_k + B_k + W_k):
    1F1B, GPipe     T = (m - 1) max_k t_k + sum_k t_k
    interleaved     T = (m + (p - 1) / v) max_k t_k          (v model chunks per device; a runtime
                    that overlaps its sends, p2p_overlap.py, hides them from the m steady-state
                    terms but not from the (p - 1) / v of the fill and flush)
    zb1p            T = m max_k t_k + sum_{k != slowest} (F_k + max(B_k - W_k, 0)) / v
                    (ZB-H1 for v = 1: each hop of the fill and drain costs F + B - W instead of
                    F + B + W, as the deferred W passes fill the drain)
    zbv             T = m max_k t_k + bubble of torch's ZB-V order laid out with the slowest
                    stage's F, B, W per chunk (schedule_sim.py: the order's bubble has no closed
                    form once W differs from F and B; it does not grow with m past 2p - 1)
W_k is the weight-gradient part of the backward: per weight-bearing op as long as its forward
(dW = X^T dY costs what Y = X W did), the rest of the backward (and the collectives, the
recompute and the sends) is B_k.
Data-parallel gradient synchronisation over the dp group:
    ZeRO 0      one all-reduce of the stage's gradients per step, overlapped with the last
                microbatch's backward except the last layer's bucket
    ZeRO 1-3    FSDP2 as codegen applies it, one unit per segment (cost_model/fsdp.py): each
                microbatch gathers every unit before its forward (ZeRO-3 again before its
                backward, in reverse order) with one unit prefetched; ZeRO-2/3 reduce-scatter
                each unit's gradients (in the reduce dtype) after its backward,
                ZeRO-1 (and any ZeRO under pipelining) only in the last microbatch. What the compute does not hide (the first
                unit's gather, gathers longer than the unit they hide behind, the last
                reduce-scatter) slows every microbatch of the stage: t_k += exposed_k. Each
                gather's copy-out and each reduce-scatter's copy-in run on the compute stream
                (memory-bound, fsdp.copy_bytes): dp.copy_out, dp.copy_in.
                What the compute hides still holds SMs while it runs: the hidden seconds x the
                library's channels / the device's SMs (cost_model/contention.py) are added where
                each collective runs: dp.all_gather.sm_contention, dp.reduce_scatter.sm_contention.
Expert parallelism (ep > 1, solver/experts.py): ep consecutive dp ranks split every expert
weight by expert; each expert matmul (or chain of them: one MoE layer, dispatched once, combined
once) adds its all-to-alls (dispatch and combine, forward and backward) over the ep group to t_k,
plus the load imbalance of dropless expert ops (the busiest rank computes load_imbalance x its
share); expert weights' states are 1/ep per device and their gradients are reduced over the
dp / ep (x cp) ranks holding the same experts: all-reduced under ZeRO-0; under ZeRO-1/2/3
FSDP2 shards them over those ranks (their own unit per segment, its all-gather and
reduce-scatter on that group, solver/step_fsdp.py) and the other weights over all data shards,
as torchtitan does.
Context parallelism (cp > 1) splits each sequence over cp ranks: the segment costs come in per
(tp, b, cp) already divided (solver/context_parallel.py, with the exposed KV exchange as
"cp.*" collectives), and the ranks holding the same parameters are dp x cp: ZeRO shards and
gradients are reduced over that group.

Step = T + exposed synchronisation + optimizer step (Adam, memory-bound, on the local shard)
     + the all-reduce of weights tied across the first and last stage (none under ZB-V: both
     stages are on rank 0).
Optimizer offload (FSDP2 CPUOffloadPolicy, ZeRO-3 without pipelining; Ren et al., ZeRO-Offload,
2021): sharded parameters, gradients and Adam states live in host memory. Each unit's shard is
copied host-to-device before each of its all-gathers (offload.h2d) and its reduced gradient
device-to-host after each reduce-scatter (offload.d2h), on the same streams as the collectives;
from the second microbatch the copy is blocking and the host adds it to the accumulated
gradient (offload.grad_accumulate). The optimizer steps on the CPU (offload.cpu_adam): the
same bytes per parameter as on the device, at the host memory bandwidth of this device's share
of the CPU. Device memory keeps activations, buffers and FSDP2's gathered units; the states are
in `host_memory_bytes`.
Memory of stage k = model states (ZeRO, memory.py) + in_flight(k) x sum_{S_k} a + buffers
     + recompute workspace (what one segment regenerates: saved - kept) + gradient workspace (the
     largest output + input gradients of one op's backward) + FSDP2's gathered units (the largest
     two consecutive units' parameters + one unit's unsharded gradients) + allocator terms
     (cost_model/allocator.py: fragmentation of the dynamic bytes, CUDA context, NCCL buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from autopar.errors import ConfigError
from autopar.mesh import Mesh
from autopar.solver.configs import (SCHEDULES, ZERO_BUBBLE_SCHEDULES, Estimate, ParallelConfig, StageEstimate,
                                    chunks_per_device)
from autopar.solver.experts import ExpertPricing
from autopar.solver.prepared import EpTimes, PreparedSegments, recompute_comm_s, recompute_compute_s, weight_grad_s
from autopar.solver.recompute import RECOMPUTE_MODES
from autopar.solver.pipeline import BALANCED, ChainCosts, StageSpan, partition, rank_of, split_spans
from autopar.solver.pipeline_time import StageTimes, chunks_in_flight, own_stages, pipeline_bound_s, pipeline_time_s
from autopar.solver.p2p_overlap import hidden_p2p_s
from autopar.solver.placement import Placement
from autopar.solver.step_fsdp import StepFsdp, fsdp_notes
from autopar.solver.step_tail import StepTail, fsdp_fuses_wgrad, tp_group, uses_fsdp
from autopar.solver.tp_overlap import overlap_regather, overlap_tp_comm
from cost_model.allocator import NO_OVERHEAD, AllocatorModel
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel
from cost_model.fsdp import unsharded_bytes
from cost_model.memory import PrecisionPolicy, accumulated_gradient_peak, model_state_memory

__all__ = ["RECOMPUTE_MODES", "SCHEDULES", "ZERO_BUBBLE_SCHEDULES", "ParallelConfig", "StageEstimate", "Estimate",
           "StepModel", "PreparedSegments", "chunks_per_device", "recompute_comm_s", "recompute_compute_s",
           "weight_grad_s"]


@dataclass(frozen=True)
class Staged:
    """A configuration's stages before the pipeline is assembled (StepModel.stages)."""

    stages: list[StageEstimate]
    """Empty when bound_s exceeded the cutoff: the stages were not priced further."""
    fits: bool
    """Built stages: whether each one's memory fits; else the split search's bound (_fits)."""
    bound_s: float
    """No step of these stages is shorter: at least m x the slowest stage's time per microbatch
    (Staged.stages empty), else the pipeline's time (pipeline_bound_s)."""


@dataclass
class StepModel(StepFsdp, StepTail):
    """Prices configurations of one model on one cluster (segment costs come in per (tp, b))."""

    devices_per_node: int
    compute: ComputeModel
    comm: CommModel
    policy: PrecisionPolicy
    memory_budget_bytes: float
    shared_params: tuple[tuple[float, tuple[int, ...]], ...] = ()
    """(numel, reading segments' indices) of each parameter read by several segments (tied
    embeddings): its segments count it once, on the first reader."""
    allocator: AllocatorModel = NO_OVERHEAD
    """CUDA context, NCCL buffers and caching-allocator fragmentation (none for CPU/gloo)."""
    expert_pricing: ExpertPricing = ExpertPricing()
    """Assumptions of the expert-parallel price (load imbalance)."""

    host_link_bytes_per_s: float = 0.0
    """Device-host copy bandwidth per device and direction (PCIe); 0: unknown, no offload."""
    host_memory_bandwidth_bytes_per_s: float = 0.0
    """Host memory bandwidth of one device's share of the CPU (the CPU Adam step)."""
    host_memory_bytes: float = 0.0
    """Host memory of one device's share of the node (offloaded states must fit)."""
    fuses_weight_grads: bool = True
    """Whether the runtime may accumulate weight gradients inside their GEMMs (codegen/fused_wgrad.py);
    False for precision "fp8", whose linears all run through torchao's override unfused."""
    segment_blocks: tuple[bool, ...] = ()
    """Per segment of the model, whether it is a repeated block: what a pipeline split by count
    counts (ParallelConfig.pipeline_split, pipeline.split_spans)."""
    _send_recv_cache: dict[tuple[float, bool], float] = field(default_factory=dict, repr=False, compare=False)
    _group_cache: dict[tuple[int, int, int], object] = field(default_factory=dict, repr=False, compare=False)
    _split_cache: dict[tuple[int, str], list[StageSpan]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def can_offload(self) -> bool:
        return self.host_link_bytes_per_s > 0 and self.host_memory_bandwidth_bytes_per_s > 0

    def state_bytes_per_param(self, config: ParallelConfig) -> float:
        if config.offload:
            return 0.0  # in host memory
        return model_state_memory(1.0, dp=config.data_shards, zero_stage=config.zero_stage,
                                  policy=self.policy).total_bytes + self.weight_copy_bytes(config)

    def weight_copy_bytes(self, config: ParallelConfig) -> float:
        """Bytes per parameter of the step's bf16 weight copies (PrecisionPolicy.casts_once_per_step),
        held from the step's start to its end; none under FSDP2, whose gathered units are the copies."""
        return self.policy.param_bytes if self.policy.casts_once_per_step and not uses_fsdp(config) else 0.0

    def chain(self, prepared: PreparedSegments, config: ParallelConfig) -> ChainCosts:
        states = prepared.param_numel * self.state_bytes_per_param(config) + prepared.buffer_bytes
        time_s = prepared.time_s
        if config.ep > 1 and prepared.expert_numel is not None:
            per_expert = model_state_memory(1.0, dp=config.expert_data_shards, zero_stage=config.zero_stage,
                                            policy=self.policy).total_bytes / config.ep \
                + self.weight_copy_bytes(config) / config.ep
            states = states + prepared.expert_numel * (per_expert - self.state_bytes_per_param(config))
            time_s = time_s + self.ep_times(prepared, config).total_s
        activations = prepared.activation_bytes * (1 + self.allocator.fragmentation_fraction)
        return ChainCosts(time_s=time_s, state_bytes=states, activation_bytes=activations)

    def ep_group(self, config: ParallelConfig):
        """The devices of one expert group: ep consecutive dp ranks (stride tp); folded, ep
        consecutive ranks of the stage's (dp, tp) grid, tp innermost (solver/expert_folding.py)."""
        if config.folds_experts:
            return Mesh(axis_names=("pp", "rep", "ep"), shape=(config.pp, config.expert_data_shards, config.ep),
                        devices_per_node=self.devices_per_node).group(2)
        return Mesh(axis_names=("pp", "dp_rep", "ep", "tp"), shape=(config.pp, config.dp // config.ep, config.ep,
                                                                     config.tp),
                    devices_per_node=self.devices_per_node).group(2)

    def ep_times(self, prepared: PreparedSegments, config: ParallelConfig) -> EpTimes:
        """Per segment: expert parallelism's all-to-alls (over the ep group where it lies: inside
        a node or across nodes), the reorder of the rows around each dispatch and combine where a
        rank holds more than one expert ("reorder", ExpertPricing.reorder_s), the busiest rank's
        extra grouped-matmul time under load imbalance (dropless ops), the change of the
        grouped matmuls' time from their ep shape (E / ep experts of ep x the rows each,
        solver/experts.py), and under ExpertPricing.tp_share_dispatch the tp group's gathers and
        reductions of the rows each rank dispatched 1/tp of."""
        key = (config.ep, config.tp, self.devices_per_node, config.folds_experts)
        if key not in prepared.ep_times:
            group = self.ep_group(config)
            imbalance = self.expert_pricing.load_imbalance
            zeros = lambda: np.zeros(len(prepared))  # noqa: E731
            times = {"fwd": zeros(), "bwd": zeros()}
            parts: dict[str, np.ndarray] = {}
            shares = self.expert_pricing.tp_share_dispatch and config.tp > 1 and not config.folds_experts
            tp_ranks = tp_group(config, self.devices_per_node) if shares else None
            terms: dict = {}  # identical blocks' messages (and matmuls, below) are priced once
            for index, messages in enumerate(prepared.ep_messages):
                for message in messages:
                    if message not in terms:
                        terms[message] = self._message_terms(message, config, group, tp_ranks, shares)
                    for part, seconds in terms[message]:
                        times[message[1]][index] += seconds
                        parts.setdefault(part, zeros())[index] += seconds
            if shares and prepared.ep_region_fwd_s is not None:
                self._replace_region_comm(prepared, times, parts)
            extra, shape = zeros(), {"fwd": zeros(), "bwd": zeros()}
            priced: dict = {}
            for index, matmuls in enumerate(prepared.ep_matmuls):
                for matmul in matmuls:
                    if matmul not in priced:
                        even = matmul.time_s(self.compute, config.ep)
                        priced[matmul] = (matmul.time_s(self.compute, config.ep, imbalance) - even,
                                          even - matmul.time_s(self.compute))
                    busier, reshaped = priced[matmul]
                    extra[index] += busier
                    shape[matmul.phase][index] += reshaped
            prepared.ep_times[key] = EpTimes(forward_s=times["fwd"], backward_s=times["bwd"], parts_s=parts,
                                             load_imbalance_s=extra, shape_forward_s=shape["fwd"],
                                             shape_backward_s=shape["bwd"])
        return prepared.ep_times[key]

    @staticmethod
    def _replace_region_comm(prepared: PreparedSegments, times: dict, parts: dict) -> None:
        """Under ExpertPricing.tp_share_dispatch each tp rank routes and dispatches its own share of
        a layer's rows, and the tp group gathers and reduces only the dispatched rows (priced in
        _message_terms): the plan's collectives that give every tp rank the layer's rows whole and
        reduce its output (SegmentCost.expert_region_comm) do not run. Taken off the segments whose
        expert ops see rows whole, as part "tp_rows_replaced" (negative)."""
        whole = np.array([float(any(message[5] for message in messages)) for messages in prepared.ep_messages])
        times["fwd"] -= whole * prepared.ep_region_fwd_s
        times["bwd"] -= whole * prepared.ep_region_bwd_s
        parts["tp_rows_replaced"] = -whole * (prepared.ep_region_fwd_s + prepared.ep_region_bwd_s)

    def _message_terms(self, message: tuple, config: ParallelConfig, group, tp_ranks,
                       shares: bool) -> tuple[tuple[str, float], ...]:
        """(breakdown part, seconds) of one message of ep_times: its all-to-all, under
        tp_share_dispatch the tp group's gather (dispatch) or reduction (combine) of the rows, and
        the reorder around it."""
        size, _, dropless, part, experts, rows_whole = message
        busiest = size * (self.expert_pricing.load_imbalance if dropless else 1.0)
        sent = busiest / config.tp if shares and rows_whole and part != "counts" else busiest
        terms = [(part, self.comm.time_s("all_to_all", sent, group))]
        if sent != busiest:  # the tp group gathers the rows it received, reduces before sending
            collective = "all_gather" if part == "dispatch" else "reduce_scatter"
            terms.append((f"tp_{collective}", self.comm.time_s(collective, busiest, tp_ranks)))
        if part != "counts":
            reorder = self.expert_pricing.reorder_s(busiest, experts, config.ep, self.compute)
            if reorder:
                terms.append(("reorder", reorder))
        return tuple(terms)

    def estimate(self, prepared: PreparedSegments, config: ParallelConfig,
                 lighter: dict[str, PreparedSegments] | None = None) -> Estimate | None:
        """Prices `config`; None when the segments cannot be split into its stages.

        `config.recompute` applies to every stage unless `lighter` offers cheaper modes (by
        name): then each stage takes the cheapest that still fits its memory (1F1B's last stages
        hold fewer microbatches than the first)."""
        staged = self.stages(prepared, config, lighter)
        return None if staged is None else self.assemble(staged.stages, staged.fits, config)

    def stages(self, prepared: PreparedSegments, config: ParallelConfig,
               lighter: dict[str, PreparedSegments] | None = None, *, cutoff_s: float = float("inf"),
               price_unfit: bool = True) -> "Staged | None":
        """The stages of `config` (see estimate) and whether they fit; None when the segments
        cannot be split into them. Every schedule's step takes at least m x the slowest stage's
        time (Staged.bound_s); when that exceeds `cutoff_s`, or when no partition fits and not
        `price_unfit`, the stages are not priced (Staged.stages is empty): that is how the
        search drops configurations early."""
        chain_key = (config.data_shards, config.dp, config.zero_stage, config.offload, config.ep)
        chain = prepared.chains.get(chain_key)
        if chain is None:
            chain = prepared.chains[chain_key] = self.chain(prepared, config)
        spans, fits = self._spans(prepared, chain, chain_key, config)
        if spans is None:
            return None
        if not fits and not price_unfit:
            return Staged(stages=[], fits=False, bound_s=0.0)
        # Each rank's placement is worked out once and read by every step below (placement.py).
        flights = chunks_in_flight(config)
        places = [self._placed(prepared, spans, config, stage, flights) for stage in range(config.pp)] \
            if cutoff_s == float("inf") else []
        if cutoff_s < float("inf"):
            # Stages that fit may take a lighter mode (_lightest): bound with the lightest.
            fastest = lighter[next(iter(lighter))] if fits and lighter else prepared
            times = []
            for stage in range(config.pp):
                places.append(self._placed(prepared, spans, config, stage, flights))
                times.append(self._stage_times(fastest, places[-1], config))
                bound_s = config.num_microbatches * times[-1].time_per_microbatch_s
                if bound_s > cutoff_s:
                    return Staged(stages=[], fits=fits, bound_s=bound_s)
            bound_s = pipeline_bound_s(config, times)
            if bound_s > cutoff_s:
                return Staged(stages=[], fits=fits, bound_s=bound_s)
        modes = [self._lightest(prepared, place, config, lighter) if fits and lighter else prepared
                 for place in places]
        if cutoff_s < float("inf"):
            # The stages' own times under the modes they take: the bound of the built stages.
            bound_s = pipeline_bound_s(config, [self._stage_times(segments, place, config)
                                                for place, segments in zip(places, modes)])
            if bound_s > cutoff_s:
                return Staged(stages=[], fits=fits, bound_s=bound_s)
        stages = [self._stage_at(segments, place, config) for place, segments in zip(places, modes)]
        # Built, the stages' own memory decides: the split search's check (_fits) bounds every
        # stage's workspace by the whole model's (the output head's gradients on the first stage too).
        fits = all(stage.total_memory_bytes <= self.memory_budget_bytes for stage in stages)
        return Staged(stages=stages, fits=fits, bound_s=pipeline_bound_s(config, stages))

    def _spans(self, prepared: PreparedSegments, chain: ChainCosts, chain_key: tuple, config: ParallelConfig):
        """(the stage partition, whether it fits): the fastest split if it fits, else the fastest
        that fits, else the fastest; (None, False) when there are fewer segments than chunks. A
        split by count (config.pipeline_split) is the partition whatever it costs or holds."""
        num_chunks = config.num_chunks
        workspace = self._workspace_bytes(prepared, config)
        if config.pipeline_split != BALANCED and num_chunks > 1:
            spans = self.counted_spans(len(prepared), num_chunks, config.pipeline_split)
            return spans, self._fits(chain, spans, config, workspace)

        flights = chunks_in_flight(config)

        def in_flight(chunk: int) -> float:
            return flights[chunk]

        if chain.time_s is prepared.time_s:
            spans = prepared.time_partition(num_chunks)
        else:  # expert parallelism's all-to-alls add to the segments' times
            # The chain's times are the segments' plus expert parallelism's (ep_times), whatever
            # the data-parallel sharding and ZeRO stage that make the rest of its key: one split each.
            time_key = (num_chunks, "ep", config.ep, config.folds_experts)
            if time_key not in prepared.time_partitions:
                prepared.time_partitions[time_key] = partition(chain, num_chunks, in_flight=in_flight)
            spans = prepared.time_partitions[time_key]
        if spans is None:
            return None, False
        if self._fits(chain, spans, config, workspace):
            return spans, True
        lean_key = (num_chunks, chain_key, flights, workspace)
        if lean_key not in prepared.lean_partitions:
            # The fastest split bounds the memory-bounded one from below (less its bisection
            # tolerance), when both split the same times.
            at_least = prepared.slowest_chunk_s(num_chunks) if chain.time_s is prepared.time_s else 0.0
            prepared.lean_partitions[lean_key] = partition(
                chain, num_chunks, in_flight=in_flight, memory_budget_bytes=self.memory_budget_bytes,
                fixed_bytes=workspace, at_least_s=at_least)
        lean = prepared.lean_partitions[lean_key]
        return (lean, True) if lean is not None else (spans, False)

    def counted_spans(self, num_segments: int, num_chunks: int, split: str) -> list[StageSpan]:
        """The chunks of a split by count (pipeline.split_spans), whatever the segments cost."""
        if len(self.segment_blocks) != num_segments:
            raise ConfigError(f"pipeline_split '{split}' needs to know which of the {num_segments} segments are "
                              "repeated blocks, and this step model was not given them")
        key = (num_chunks, split)
        if key not in self._split_cache:
            self._split_cache[key] = split_spans(self.segment_blocks, num_chunks, split)
        return self._split_cache[key]

    def _lightest(self, prepared: PreparedSegments, place: Placement, config: ParallelConfig,
                  lighter: dict[str, PreparedSegments]) -> PreparedSegments:
        """The segments of the cheapest lighter mode whose memory fits this stage (its own mode's
        otherwise); a mode's varying memory is checked before its whole stage's. Identical stages
        (the same segments in every mode, microbatches in flight and sends) decide once."""
        key = (place.signature(prepared), tuple(place.signature(segments) for segments in lighter.values()),
               tuple(place.in_flight), place.p2p_s, config.dp, config.cp, config.tp, config.pp, config.zero_stage,
               config.ep, config.offload, config.num_microbatches if config.offload else 0, config.recompute,
               place.stage if _accumulates_unsharded(config) else None)  # the peak follows the rank's order there
        if key not in prepared.lightest_cache:
            prepared.lightest_cache[key] = self._lightest_uncached(prepared, place, config, lighter)
        mode = prepared.lightest_cache[key]
        return prepared if mode is None else lighter[mode]

    def _lightest_uncached(self, prepared, place: Placement, config, lighter) -> str | None:
        budget = self.memory_budget_bytes
        unchanged = self._stage_memory_bytes(prepared, place, config) - self._mode_bytes(prepared, place, config)
        for mode in RECOMPUTE_MODES:
            if mode == config.recompute:
                break
            if mode not in lighter or unchanged + self._mode_bytes(lighter[mode], place, config) > budget * (1 + 1e-9):
                continue
            if self._stage_memory_bytes(lighter[mode], place, config) <= budget:
                return mode
        return None

    def _mode_bytes(self, prepared: PreparedSegments, place: Placement, config: ParallelConfig) -> float:
        """The part of a stage's memory that depends on its recomputation mode (see _stage)."""
        own = place.own
        activations = sum(count * prepared.total("activation_bytes", (span,))
                          for count, span in zip(place.in_flight, own))
        terms = self._workspace_terms(prepared, config, own, with_fsdp=False, signature=place.signature(prepared))
        varying = activations + terms["recompute_workspace"] + terms["gradient_workspace"]
        return varying + self.allocator.fragmentation_bytes(varying)

    def _fits(self, chain: ChainCosts, spans, config: ParallelConfig, workspace: float) -> bool:
        flights = chunks_in_flight(config)
        states, activations = chain.prefix_list("state_bytes"), chain.prefix_list("activation_bytes")
        for stage in range(config.pp):
            memory = 0.0
            for s in own_stages(config, stage):
                span = spans[s]
                memory += (states[span.stop] - states[span.start]
                           + flights[s] * (activations[span.stop] - activations[span.start]))
            if memory + workspace > self.memory_budget_bytes:
                return False
        return True

    def _workspace_bytes(self, prepared: PreparedSegments, config: ParallelConfig) -> float:
        """Memory every stage holds besides states and activations (an upper bound over stages)."""
        whole, signature = prepared.whole
        terms = self._workspace_terms(prepared, config, whole, signature=signature)
        return sum(terms.values())

    def _workspace_terms(self, prepared: PreparedSegments, config: ParallelConfig, own, *,
                         with_fsdp: bool = True, signature: tuple[int, ...] | None = None) -> dict[str, float]:
        key = (prepared.signature(own) if signature is None else signature, with_fsdp, config.recompute == "none", config.zero_stage, config.data_shards,
               config.offload, _num_communicators(config), _accumulates_unsharded(config), config.ep)
        if key not in prepared.workspace_cache:
            prepared.workspace_cache[key] = self._workspace_terms_uncached(prepared, config, own, with_fsdp)
        return dict(prepared.workspace_cache[key])

    def _workspace_terms_uncached(self, prepared: PreparedSegments, config: ParallelConfig, own,
                                  with_fsdp: bool) -> dict[str, float]:
        recompute = prepared.max_recomputed_bytes if config.recompute != "none" else 0.0
        fsdp = 0.0
        if with_fsdp and config.zero_stage >= 2 and (config.data_shards > 1 or config.offload):  # offload: FSDP2 even at dp = 1
            # ZeRO-2 keeps parameters gathered (counted as "parameters"): only a unit's gradients,
            # and not even those where every unit's unsharded gradients are counted as
            # "gradients" (accumulated until the step's reduce-scatter under pipelining).
            param_bytes = self.policy.fsdp_gather_bytes if config.zero_stage == 3 else 0.0
            accumulated = _accumulates_unsharded(config) and not config.offload
            units = prepared.values("param_numel", own)  # a segment's units, gathered one after the other
            if config.ep > 1 and prepared.expert_numel is not None:  # hold this rank's experts only
                units = [numel - experts * (1 - 1 / config.ep)
                         for numel, experts in zip(units, prepared.values("expert_numel", own))]
            fsdp = unsharded_bytes(units, param_bytes=param_bytes,
                                   grad_bytes=0.0 if accumulated else self.policy.dp_reduce_bytes,
                                   root_ends=self.fsdp_root_ends(config, units),
                                   held_grad_bytes=0.0 if accumulated else self.policy.fsdp_gather_bytes)
        gradients = 0.0
        if prepared.grad_workspace_bytes is not None and len(prepared):
            gradients = max([0.0, *prepared.values("grad_workspace_bytes", own)])
        fragmentation = self.allocator.fragmentation_bytes(recompute + fsdp + gradients)
        return {"recompute_workspace": recompute, "gradient_workspace": gradients, "fsdp_unsharded": fsdp,
                "fragmentation": fragmentation,
                "cuda_context": self.allocator.context_bytes(_num_communicators(config))}

    def _stage_at(self, prepared: PreparedSegments, place: Placement, config: ParallelConfig) -> StageEstimate:
        """One device's stage (a device owns chunks k, k + p, ... when interleaved)."""
        return self._stage(place.stage, place.own, prepared, config, place.p2p_s, place.in_flight,
                           signature=place.signature(prepared))

    def _stage_times(self, prepared: PreparedSegments, place: Placement, config: ParallelConfig) -> StageTimes:
        """The times of _stage_at(...) the pipeline's length depends on, without building it."""
        parts = self._stage_parts_cached(place.own, prepared, config, place.p2p_s, place.signature(prepared))
        return StageTimes(parts["time_per_microbatch_s"], parts["forward_pass_s"], parts["weight_grad_s"],
                          parts["p2p_hidden_s"])

    def _placed(self, prepared: PreparedSegments, spans, config: ParallelConfig, stage: int,
                flights: tuple[float, ...]) -> Placement:
        """Pipeline rank `stage`'s placement (placement.py); `flights`: chunks_in_flight(config)."""
        crosses_nodes = config.data_shards * config.tp >= self.devices_per_node
        stage_indices = own_stages(config, stage)
        own = [spans[s] for s in stage_indices]
        # A stage sends to the next one unless it is the last or the next runs on the same rank
        # (the turn of ZB-V's V).
        outputs, count = prepared.listed("output_bytes"), len(prepared)
        gathered = prepared.listed("gathered_output_bytes") if prepared.gathered_output_bytes is not None else None
        p2p = 0.0
        for s, span in zip(stage_indices, own):
            if span.stop < count and rank_of(config.schedule, stage=s + 1, num_ranks=config.pp) != stage:
                p2p += 2 * self._send_recv_s(outputs[span.stop - 1], crosses_nodes)
            if gathered and span.start > 0 and gathered[span.start - 1] and \
                    rank_of(config.schedule, stage=s - 1, num_ranks=config.pp) != stage:
                p2p += self._tp_gather_s(gathered[span.start - 1], config)
        return Placement(stage=stage, stage_indices=stage_indices, own=own,
                         in_flight=[flights[s] for s in stage_indices], p2p_s=p2p)

    def _tp_gather_s(self, message_bytes: float, config: ParallelConfig) -> float:
        """All-gather over the tp ranks of an activation received as slices (its gradient's
        reduction is the plan's: a reduce-scatter here and an all-gather on the sender cost the
        all-reduce the plan prices in backward)."""
        key = ("tp_gather", message_bytes, config.pp, config.data_shards, config.tp)
        if key not in self._send_recv_cache:
            mesh = Mesh(axis_names=("pp", "dp_cp", "tp"), shape=(config.pp, config.data_shards, config.tp),
                        devices_per_node=self.devices_per_node)
            self._send_recv_cache[key] = self.comm.time_s("all_gather", message_bytes, mesh.group(2))
        return self._send_recv_cache[key]

    def _send_recv_s(self, message_bytes: float, crosses_nodes: bool) -> float:
        key = (message_bytes, crosses_nodes)
        if key not in self._send_recv_cache:
            self._send_recv_cache[key] = self.comm.send_recv_s(message_bytes, crosses_nodes=crosses_nodes)
        return self._send_recv_cache[key]

    def _tied_numel_held(self, own, num_segments: int, config: ParallelConfig) -> tuple[float, float]:
        """(numel of copies, numel held whole) of the shared weights on a rank whose chunks are
        `own`. Each pipeline rank that reads one keeps its own copy (codegen/pipeline.py): the
        segments count it once, on its first reader, so a rank reading it without that segment
        holds a copy more. A rank whose two chunks read it (ZB-V's rank 0 with the embedding and
        the head) holds it whole under FSDP, as ZeRO-0 (codegen/data_parallel.py: two chunks' FSDP
        units cannot share a sharded parameter)."""
        if config.pp <= 1:
            return 0.0, 0.0
        copies = whole = 0.0
        for (numel, _), (reads, owns, chunks) in zip(self.shared_params, self._shared_held(own)):
            if reads and not owns:
                copies += numel / config.tp
            elif owns and chunks > 1 and uses_fsdp(config) and config.data_shards > 1:
                whole += numel / config.tp
        return copies, whole

    def _shared_held(self, own) -> tuple[tuple[bool, bool, int], ...]:
        """Per shared weight: whether these chunks read it, hold its first reader, and how many
        of them read it."""
        held = []
        for _, readers in self.shared_params:
            chunks = sum(any(span.start <= reader < span.stop for reader in readers) for span in own)
            owns = any(span.start <= readers[0] < span.stop for span in own)
            held.append((chunks > 0, owns, chunks))
        return tuple(held)

    def _states(self, numel: float, expert_numel: float, config: ParallelConfig) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes on a device for numel parameters, of them
        expert_numel experts split over ep ranks."""
        states = model_state_memory(numel - expert_numel, dp=config.data_shards, zero_stage=config.zero_stage,
                                    policy=self.policy)
        params, grads, optimizer = states.params_bytes, states.grads_bytes, states.optimizer_bytes
        if expert_numel:
            # The ranks holding the same experts (FSDP's shards of them): dp / ep x cp (folded: x tp).
            experts = model_state_memory(expert_numel / config.ep, dp=config.expert_data_shards,
                                         zero_stage=config.zero_stage, policy=self.policy)
            params, grads = params + experts.params_bytes, grads + experts.grads_bytes
            optimizer += experts.optimizer_bytes
        return params, grads, optimizer

    def _stage_memory_bytes(self, prepared: PreparedSegments, place: Placement, config) -> float:
        """_stage(...).total_memory_bytes, without building the stage."""
        parts = self._stage_parts_cached(place.own, prepared, config, place.p2p_s, place.signature(prepared))
        return sum(self._stage_memory(parts, prepared, place.own, place.in_flight, config, place.stage).values())

    def _stage_memory(self, parts: dict, prepared: PreparedSegments, own, in_flight: list[float],
                      config: ParallelConfig, rank: int) -> dict[str, float]:
        """A stage's memory by term: its parts' (_stage_parts) with its activations added. Where
        gradients accumulate unsharded until the step's reduce-scatter (_accumulates_unsharded),
        activations and gradients are those at the rank's peak of the two together: a chunk has
        no gradients before its first backward of the step."""
        chunk_activations = [prepared.total("activation_bytes", (span,)) for span in own]
        activations = sum(count * size for count, size in zip(in_flight, chunk_activations))
        memory = dict(parts["memory_bytes"])
        if _accumulates_unsharded(config) and not config.offload:
            chunk_gradients = tuple(self._local_numel(prepared, (span,), config) * self.policy.dp_reduce_bytes
                                    for span in own)
            peak = accumulated_gradient_peak(config.schedule, rank=rank, num_stages=config.pp,
                                             num_microbatches=config.num_microbatches,
                                             virtual_stages=config.chunks_per_device,
                                             chunk_activation_bytes=tuple(chunk_activations),
                                             chunk_gradient_bytes=chunk_gradients)
            if peak is not None:
                activations, memory["gradients"] = peak
        memory["activations"] = activations
        memory["fragmentation"] += self.allocator.fragmentation_bytes(activations)
        return memory

    @staticmethod
    def _local_numel(prepared: PreparedSegments, own, config: ParallelConfig) -> float:
        """Parameters of these segments on a device before ZeRO sharding: 1/ep of the experts."""
        numel = prepared.total("param_numel", own)
        if config.ep > 1 and prepared.expert_numel is not None:
            numel -= prepared.total("expert_numel", own) * (1 - 1 / config.ep)
        return numel

    def _stage(self, stage, own, prepared: PreparedSegments, config, p2p, in_flight: list[float], *,
               signature: tuple[int, ...] | None = None) -> StageEstimate:
        # Identical stages (a deep model's middle ones) share everything but their activations,
        # which depend on the microbatches in flight, and their names.
        parts = self._stage_parts_cached(own, prepared, config, p2p, signature)
        memory = self._stage_memory(parts, prepared, own, in_flight, config, stage)
        chunks = tuple(tuple(prepared.names[span.start:span.stop]) for span in own)
        # The other dicts are shared between identical stages: nothing changes a priced stage.
        return StageEstimate(index=stage, span=StageSpan(own[0].start, own[-1].stop),
                             segment_names=tuple(name for chunk in chunks for name in chunk), chunks=chunks,
                             **{**parts, "memory_bytes": memory})

    def _stage_parts_cached(self, own, prepared: PreparedSegments, config, p2p,
                            signature: tuple[int, ...] | None = None) -> dict:
        """_stage_parts through prepared.stage_cache; `signature`: prepared.signature(own), if known."""
        key = (prepared.signature(own) if signature is None else signature, p2p, config.dp, config.cp, config.tp, config.pp, config.zero_stage,
               config.ep, config.offload, config.num_microbatches if config.offload else 0, config.recompute == "none",
               self._fuses_wgrad(config), config.schedule if self.policy.p2p_overlap else "",
               _holds_ends(own, len(prepared)), self._shared_held(own))
        parts = prepared.stage_cache.get(key)
        if parts is None:
            parts = prepared.stage_cache[key] = self._stage_parts(own, prepared, config, p2p)
        return parts

    def _stage_parts(self, own, prepared: PreparedSegments, config, p2p) -> dict:
        """StageEstimate's fields for a stage of these segments, but where it sits (index, span,
        names) and its activations ("activations" in memory_bytes is 0 here)."""
        total = prepared.total
        tied_copy, tied_whole = self._tied_numel_held(own, len(prepared), config)
        numel = total("param_numel", own) + tied_copy
        expert_numel = total("expert_numel", own) if config.ep > 1 and prepared.expert_numel is not None else 0.0
        params, grads, optimizer = self._states(numel, expert_numel, config)
        if tied_whole:
            params, grads, optimizer = (state + whole - sharded for state, whole, sharded in
                                        zip((params, grads, optimizer), self._states(tied_whole, 0.0, replace(config, zero_stage=0)),
                                            self._states(tied_whole, 0.0, config)))
        numel -= expert_numel * (1 - 1 / config.ep)
        copies = numel * self.weight_copy_bytes(config)
        if _accumulates_unsharded(config):
            # Without gradient sync until the last microbatch FSDP2 accumulates unsharded gradients.
            grads = numel * self.policy.dp_reduce_bytes
        host: dict[str, float] = {}
        if config.offload:
            host = {"host.parameters": params, "host.gradients": grads, "host.optimizer": optimizer}
            params = grads = optimizer = 0.0
        memory = {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": 0.0,
                  "buffers": total("buffer_bytes", own), **({"weight_copies": copies} if copies else {}),
                  **self._workspace_terms(prepared, config, own)}
        tp_comm = {op: total("comm:" + op, own) for op in prepared.comm_by_op_s}
        overlap_s = 0.0
        if self.policy.tp_comm_overlap:  # the runtime hides its SP collectives behind GEMMs (tp_overlap.py)
            tp_comm, overlap_s = overlap_tp_comm(tp_comm, tp=config.tp, share=self.comm_sm_share(),
                                                 compute_s=total("forward_s", own) + total("backward_s", own),
                                                 sums=self.policy.tp_overlap_sums,
                                                 caps_s={op: total("cap:" + op, own) for op in prepared.overlap_caps_s})
        elif self.policy.regather_overlap:  # re-gathers beside the dgrad GEMMs (tp_overlap.py)
            tp_comm, overlap_s = overlap_regather(tp_comm, backward_s=total("backward_s", own),
                                                  share=self.comm_sm_share())
        timeline, exposed, step_end, offload = self._fsdp(prepared, own, config)
        ep_s, ep_segments, (ep_forward, ep_backward) = self._ep_parts(prepared, own, config)
        fused = self._fuses_wgrad(config) and prepared.fused_wgrad_numel is not None
        saving = total("fused_wgrad_saving_s", own) if fused else 0.0
        p2p_hidden = hidden_p2p_s(p2p, compute_s=total("forward_s", own) + total("backward_s", own),
                                  schedule=config.schedule, num_stages=config.pp) if self.policy.p2p_overlap else 0.0
        time_per_microbatch = (total("time_s", own) + overlap_s + p2p - p2p_hidden + sum(exposed.values())
                               + sum(ep_s.values()) + ep_forward + ep_backward + sum(offload.values()) - saving)
        forward = total("forward_s", own) + ep_forward
        return dict(time_per_microbatch_s=time_per_microbatch, forward_s=forward,
                    backward_s=total("backward_s", own) + ep_backward - saving,
                    fused_wgrad_numel=total("fused_wgrad_numel", own) if fused else 0.0,
                    recompute_s=total("recompute_s", own), tp_comm_s=tp_comm, p2p_s=p2p, p2p_hidden_s=p2p_hidden,
                    param_numel=numel,
                    memory_bytes=memory, recompute=prepared.recompute, fsdp=timeline, fsdp_exposed_s=exposed,
                    fsdp_step_end_s=step_end, expert_param_numel=expert_numel / config.ep, ep_s=ep_s,
                    ep_segment_s=ep_segments, forward_pass_s=forward + total("forward_comm_s", own) + p2p / 2,
                    weight_grad_s=total("weight_grad_s", own), host_memory_bytes=host, offload_s=offload,
                    grad_reduce_s=total("grad_reduce_s", own) if prepared.grad_reduce_s is not None else 0.0,
                    shared_held=tuple(reads for reads, _, _ in self._shared_held(own)))

    def _fuses_wgrad(self, config: ParallelConfig) -> bool:
        """Whether the runtime accumulates weight gradients inside their GEMMs in this configuration
        (codegen/fused_wgrad.py): into the fp32 .grad behind the step's bf16 copies, or under FSDP2
        into its fp32 unsharded accumulator where it keeps one (step_tail.fsdp_fuses_wgrad); not
        under the zero-bubble schedules (torch's weight pass adds the gradients itself)."""
        fsdp_ok = not uses_fsdp(config) or fsdp_fuses_wgrad(
            zero_stage=config.zero_stage, pp=config.pp, num_microbatches=config.num_microbatches,
            offload=config.offload)
        return self.fuses_weight_grads and self.policy.casts_once_per_step and fsdp_ok \
            and config.schedule not in ZERO_BUBBLE_SCHEDULES

    def _ep_parts(self, prepared: PreparedSegments, own, config: ParallelConfig):
        """Expert parallelism on a stage: seconds per microbatch by breakdown part ("dispatch",
        "combine", "counts" all-to-alls, "load_imbalance"), per segment, and the (forward,
        backward) change of the stage's expert compute from the ep shape of its grouped matmuls."""
        if config.ep <= 1 or prepared.expert_numel is None:
            return {}, (), (0.0, 0.0)
        indices = [i for span in own for i in range(span.start, span.stop)]
        times = self.ep_times(prepared, config)
        parts = {part: float(seconds[indices].sum()) for part, seconds in sorted(times.parts_s.items())}
        imbalance = times.load_imbalance_s
        if imbalance[indices].any():
            parts["load_imbalance"] = float(imbalance[indices].sum())
        forward, backward = times.forward_s, times.backward_s
        segments = tuple((prepared.names[i], float(forward[i] + imbalance[i] / 3), float(backward[i] + 2 * imbalance[i] / 3))
                         for i in indices if forward[i] or backward[i] or imbalance[i])
        shape = (float(times.shape_forward_s[indices].sum()), float(times.shape_backward_s[indices].sum()))
        return parts, segments, shape

    def assemble(self, stages: list[StageEstimate], fits: bool, config: ParallelConfig) -> Estimate:
        m = config.num_microbatches
        slowest = max(stages, key=lambda s: s.time_per_microbatch_s)
        t_max = slowest.time_per_microbatch_s
        pipeline_s = pipeline_time_s(config, stages, slowest)
        sync_s = max(self._dp_sync_exposed_s(stage, config) for stage in stages)
        optimizer_s = 0.0 if config.offload else max(self._optimizer_s(stage, config) for stage in stages)
        cpu_adam_s = max(self._cpu_adam_s(stage, config) for stage in stages) if config.offload else 0.0
        tied_s = self._tied_sync_s(config, stages)
        cast_s = max(self._weight_cast_s(stage, config) for stage in stages)
        accumulate_s = max(self._gradient_accumulate_s(stage, config) for stage in stages)
        grad_reduce_s = max(stage.grad_reduce_s for stage in stages)
        breakdown = {"compute": m * (slowest.forward_s + slowest.backward_s), "recompute": m * slowest.recompute_s}
        for op, seconds in sorted(slowest.tp_comm_s.items()):
            breakdown[op if op.startswith("cp.") else f"tp.{op}"] = m * seconds
        for part, seconds in sorted(slowest.ep_s.items()):
            breakdown[f"ep.{part}"] = m * seconds
        breakdown["pp.send_recv"] = m * (slowest.p2p_s - slowest.p2p_hidden_s)
        breakdown["bubble"] = pipeline_s - m * t_max
        if config.zero_stage == 0:
            breakdown["dp.gradient_sync"] = sync_s
        # dp.<op>: exposed inside every microbatch (part of the stage time); dp.<op>.once: once
        # per step, after the pipeline (ZeRO-1/2 gathers, reductions made in the last microbatch).
        synced = max(stages, key=lambda s: sum(s.fsdp_step_end_s.values()))
        for op, seconds in sorted(slowest.fsdp_exposed_s.items()):
            breakdown[f"dp.{op}"] = m * seconds
        for op, seconds in sorted(synced.fsdp_step_end_s.items()):
            breakdown[f"dp.{op}.once"] = seconds
        for term, seconds in sorted(slowest.offload_s.items()):
            breakdown[term] = m * seconds
        breakdown["optimizer"] = optimizer_s
        if cast_s:
            breakdown["weight_cast"] = cast_s
        if accumulate_s:
            breakdown["gradient_accumulate"] = accumulate_s
        if grad_reduce_s:
            breakdown["tp.grad_reduce.once"] = grad_reduce_s
        if config.offload:
            breakdown["offload.cpu_adam"] = cpu_adam_s
        if tied_s:
            breakdown["pp.tied_weights"] = tied_s
        peak = max(stages, key=lambda s: s.total_memory_bytes)
        host_peak = max(stages, key=lambda s: sum(s.host_memory_bytes.values()))
        host_fits = not config.offload or sum(host_peak.host_memory_bytes.values()) <= self.host_memory_bytes
        return Estimate(config=config, step_time_s=pipeline_s + sync_s + optimizer_s + cpu_adam_s + tied_s + cast_s
                        + accumulate_s + grad_reduce_s,
                        breakdown_s=breakdown, stages=tuple(stages), peak_memory_bytes=peak.total_memory_bytes,
                        memory_bytes=dict(peak.memory_bytes),
                        fits=fits and host_fits and peak.total_memory_bytes <= self.memory_budget_bytes,
                        notes=fsdp_notes(slowest, config) + self._offload_notes(host_peak, config),
                        host_memory_bytes=dict(host_peak.host_memory_bytes))


def _accumulates_unsharded(config: ParallelConfig) -> bool:
    """FSDP (ZeRO-2/3) under pipelining: no gradient sync before the last microbatch, so every
    chunk's gradients accumulate unsharded in the reduce dtype until the step's reduce-scatter."""
    return config.pp > 1 and config.zero_stage >= 2 and config.data_shards > 1


def _num_communicators(config: ParallelConfig) -> int:
    """Process groups a rank talks on: one per mesh axis of size > 1."""
    return sum(1 for size in (config.dp, config.cp, config.tp, config.pp, config.ep) if size > 1)


def _holds_ends(own, num_segments: int) -> tuple[bool, bool]:
    """Whether these chunks hold the model's first segment, and its last."""
    return any(span.start == 0 for span in own), any(span.stop == num_segments for span in own)

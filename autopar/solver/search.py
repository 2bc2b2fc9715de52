"""Whole-cluster search: mesh shape, microbatching, schedule, recomputation and ZeRO stage.

For every factorisation of the devices into pp x dp x cp x tp (tensor parallel inside a node
unless constrained otherwise; context parallelism only for models whose sequence can be split,
solver/context_parallel.py), every microbatch size dividing the per-replica batch, the 1F1B,
interleaved and zero-bubble (zb1p, zbv) schedules, each recomputation mode and ZeRO stage, and for a model with expert
matmuls every expert-parallel degree dividing dp (experts sharded over ep of the dp ranks,
solver/experts.py; with every ZeRO stage and cp, as codegen runs it; and MoE parallel folding,
etp = 1 with tp > 1, the ep group over tp x dp, where codegen runs it: cp = 1, not with module
recomputation, solver/expert_folding.py), the step model (step_model.py)
prices the configuration from the intra-op solution of the tensor-parallel mesh at that
microbatch size (solved once per (tp, microbatch) and reused for every pp, dp and cp). The fastest
configuration that fits in memory wins; ties go to the leaner one.

What is not priced, and why that loses nothing (the best `keep` are exact under the step model):
- a heavier recomputation mode where a lighter one fits with the same schedule, ZeRO stage and
  ep (with less work it only adds recomputation), and ZeRO-2 under pipelining (it reduces once,
  in the last microbatch, as ZeRO-1 does, and holds more);
- a configuration whose lower bound exceeds the `keep`-th best found so far: first from its
  segments alone (an even share of the work and the slowest chunk of the most balanced cut, in
  the schedule's formula), then from its stages' times under the lightest mode they may take,
  then from their times under the modes they do take (pipeline_bound_s, before any stage is
  built: the ZB-V bubble is laid out last);
- once a configuration fits, configurations no stage partition fits (only the leanest of them
  matters, for the message when none fits).

The cutoff is the keep-th best step time found so far (Board). Meshes are priced in the order of
their first microbatch's least lower bound, so that fast plans come early, and with
SearchOptions.jobs > 1 in forked workers that share the cutoff (parallel_search.py); the ranking
breaks ties by mesh number and order found, so neither changes it, only what is priced.

Optimizer offload (FSDP2 CPUOffloadPolicy with ZeRO-3, no pipelining) is searched only when no
configuration fits without it (or when a constraint asks for it): it trades device memory for
host copies and a CPU optimizer step, which a plan that fits never needs.

This module holds the Planner's public face and the search loop. What is enumerated is in
enumerate.py, what is checked in constraints.py, what is priced (and the lower bounds) in
pricing.py, the keep-best Board in board.py, the worker processes in parallel_search.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autopar.cluster import Cluster
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import OpGraph
from autopar.solver.board import Board, Found
from autopar.solver.condense import condense
from autopar.solver.constraints import ConfigChecks, Constraints
from autopar.solver.context_parallel import sequence_length
from autopar.solver.enumerate import Candidates, MeshDegrees
from autopar.solver.evaluate import SegmentCost
from autopar.solver.fp8 import Fp8Choice
from autopar.solver.fp8_pricing import Fp8Pricing
from autopar.solver.experts import ExpertPricing, find_expert_ops
from autopar.solver.overheads import Overheads, SegmentCounts
from autopar.solver.parallel_search import search_in_workers, search_jobs
from autopar.solver.pipeline import block_flags
from autopar.solver.pricing import Pricing, TpKey, lower_bound_s
from autopar.solver.sharding import ShardingOptions, ShardingResult
from autopar.solver.step_model import Estimate, ParallelConfig, PreparedSegments, StepModel
from autopar.strategies.attention import context_parallel_blocker
from autopar.validation import human_bytes
from cost_model.allocator import DEFAULT_ALLOCATOR, NO_OVERHEAD, AllocatorModel
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel
from cost_model.memory import BF16_ADAM, PrecisionPolicy
from cost_model.optimizer import OPTIMIZER_IMPLEMENTATIONS, adamw_io_bytes_per_param


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    usable_memory_fraction: float = 1.0
    """Share of device memory the plan may use; the CUDA context, NCCL buffers and allocator
    fragmentation are terms of the memory breakdown (`allocator`), not a margin here."""
    allocator: AllocatorModel | None = None
    """Memory beyond the plan's tensors; None: cost_model.allocator's defaults on GPUs, none on CPUs."""
    max_microbatch_size: int = 64
    sharding: ShardingOptions = ShardingOptions()
    experts: ExpertPricing = ExpertPricing()
    """Assumptions of the expert-parallel price (the load imbalance of dropless routing)."""
    min_tokens_per_cp_rank: int = 1024
    """Context-parallel degrees searched leave each rank at least this many tokens of a sequence
    (smaller blocks cannot hide the KV exchange behind their attention); a constraint overrides."""
    cp_kv_exchange: str = "all_gather"
    """How context parallelism moves keys and values: "all_gather" (Llama 3's; autopar's runtime),
    "ring", or torch's `context_parallel` as it runs, "torch" eager or "torch_compiled" with the
    attention compiled (what torchtitan ran: cost_model/context_parallel.py)."""
    jobs: int | None = None
    """Processes that price configurations (forked after the capture, solver/parallel_search.py);
    None: $AUTOPAR_JOBS if set, else the usable cores (at most 8), and 1 for a small search."""
    optimizer: str | None = None
    """How the training script's AdamW runs: "foreach" (`torch.optim.AdamW`'s default), "fused"
    (`fused=True`, Apex, torchtitan); None: the precision policy's (foreach for autopar's runtime).
    It prices the optimizer step (cost_model/optimizer.py)."""

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.optimizer not in OPTIMIZER_IMPLEMENTATIONS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)} (how AdamW runs: "
                              f"'foreach' is torch.optim.AdamW's default, 'fused' is AdamW(fused=True)) or None, "
                              f"got {self.optimizer!r}")
        if self.jobs is not None and (isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1):
            raise ConfigError(f"jobs must be an integer >= 1 (processes that price configurations; 1: search in "
                              f"this process) or None (the usable cores), got {self.jobs!r}")


@dataclass
class SearchResult:
    best: Estimate
    sharding: ShardingResult
    num_configs: int
    num_sharding_solves: int
    search_time_s: float
    ranked: list[Estimate] = field(default_factory=list)
    """The best few configurations, fastest first."""


Progress = Callable[[str], None]


class Planner:
    """Plans one captured model on one cluster for one global batch size."""

    def __init__(self, graph: OpGraph, cluster: Cluster, *, global_batch: int, policy: PrecisionPolicy = BF16_ADAM,
                 precision: str = "bf16", options: SearchOptions = SearchOptions(),
                 progress: Progress | None = None, overheads: Overheads | None = None,
                 fp8: Fp8Choice | None = None) -> None:
        if global_batch < 1:
            raise ConfigError(f"global batch must be >= 1, got {global_batch}")
        self.graph = graph
        self.cluster = cluster
        self.global_batch = global_batch
        if options.optimizer is not None:
            policy = replace(policy, optimizer_io_bytes_per_param=adamw_io_bytes_per_param(options.optimizer))
        self.policy = policy
        self.precision = precision
        """Name of the precision policy ("bf16", "fp32" or "fp8"), recorded in plans."""
        self.fp8 = fp8
        """Precision "fp8": its recipe and the linears run in float8 (solver/fp8.py); else None."""
        self.options = options
        self.progress = progress or (lambda message: None)
        self.step_model = StepModel(
            devices_per_node=cluster.devices_per_node, compute=ComputeModel(cluster.device, cluster.profile),
            comm=CommModel(cluster), policy=policy,
            memory_budget_bytes=cluster.device.memory_bytes * options.usable_memory_fraction,
            shared_params=_shared_params(graph), allocator=_allocator(cluster, options),
            segment_blocks=block_flags(graph.segments),
            expert_pricing=options.experts,

            host_link_bytes_per_s=cluster.device.host_link_bytes_per_s, fuses_weight_grads=fp8 is None,
            host_memory_bandwidth_bytes_per_s=cluster.device.host_memory_bandwidth_bytes_per_s,
            host_memory_bytes=cluster.device.host_memory_bytes)
        self.overheads = overheads
        """Calibrated whole-step terms (overheads.py), or None to price kernels and collectives only."""
        self.condensed = condense(graph)
        self.expert_ops = find_expert_ops(self.condensed)
        """The expert matmuls expert parallelism can split (solver/experts.py)."""
        self.sequence_length = sequence_length(graph)
        self.cp_blocker = context_parallel_blocker(graph, self.sequence_length)
        """Why the sequence cannot be split over cp ranks ("" when it can)."""
        self.pricing = Pricing(graph=graph, condensed=self.condensed, cluster=cluster, policy=policy,
                               step_model=self.step_model, overheads=overheads, sharding_options=options.sharding,
                               cp_kv_exchange=options.cp_kv_exchange, expert_ops=self.expert_ops)
        """Intra-op solves, segment costs and estimates, cached (pricing.py)."""
        self.moe_load_imbalance = options.experts.load_imbalance if self.expert_ops else None
        """The load imbalance expert ops were priced with (None: the model has none), recorded in plans."""
        if fp8 is not None:
            self.pricing.fp8 = Fp8Pricing(graph, fp8, compute=self.step_model.compute, comm=self.step_model.comm,
                                          devices_per_node=cluster.devices_per_node,
                                          memory_budget_bytes=self.step_model.memory_budget_bytes, auto=fp8.auto,
                                          load_imbalance=options.experts.load_imbalance)
        self.checks = ConfigChecks(graph=graph, cluster=cluster, global_batch=global_batch, step_model=self.step_model,
                                   expert_ops=self.expert_ops, ep_options=self.pricing.ep_options,
                                   folding_blocker=self.pricing.folding_blocker,
                                   sequence_length=self.sequence_length, cp_blocker=self.cp_blocker)
        """Checks of a configuration against the model, the cluster and the batch (constraints.py)."""
        self.candidates = Candidates(graph=graph, cluster=cluster, global_batch=global_batch, policy=policy,
                                     pricing=self.pricing, checks=self.checks,
                                     max_microbatch_size=options.max_microbatch_size,
                                     min_tokens_per_cp_rank=options.min_tokens_per_cp_rank)
        """The meshes and configurations the search may price (enumerate.py)."""

    @property
    def num_blocks(self) -> int:
        return sum(1 for segment in self.graph.segments if segment.block_group is not None)

    # --- what is priced (pricing.Pricing) ----------------------------------------------------

    @staticmethod
    def tp_key(tp: int, microbatch_size: int, sequence_parallel: bool = True) -> TpKey:
        """What an intra-op solve depends on (pricing.Pricing.tp_key)."""
        return Pricing.tp_key(tp, microbatch_size, sequence_parallel)

    def sharding(self, tp: int, microbatch_size: int, sequence_parallel: bool = True,
                 folded: bool = False) -> ShardingResult:
        """Intra-op solution on a tp mesh at one microbatch size (of the condensed graph); folded:
        with the MoE layers token-local (etp = 1, solver/expert_folding.py)."""
        return self.pricing.sharding(tp, microbatch_size, sequence_parallel, folded)

    def strategies(self, tp: int, microbatch_size: int, sequence_parallel: bool = True, folded: bool = False) -> dict:
        """Strategy of every node of the full graph (dropped blocks take their stand-in's)."""
        return self.pricing.strategies(tp, microbatch_size, sequence_parallel, folded)

    def segment_costs(self, tp: int, microbatch_size: int, cp: int = 1,
                      sequence_parallel: bool = True, folded: bool = False) -> list[SegmentCost]:
        """Per segment of the full model; with cp > 1 per rank of a sequence split over cp ranks."""
        return self.pricing.segment_costs(tp, microbatch_size, cp, sequence_parallel, folded)

    def prepared(self, tp: int, microbatch_size: int, recompute: str, cp: int = 1,
                 sequence_parallel: bool = True) -> PreparedSegments:
        return self.pricing.prepared(tp, microbatch_size, recompute, cp, sequence_parallel)

    def prepared_for(self, config: ParallelConfig, recompute: str | None = None) -> PreparedSegments:
        """The prepared segments of a configuration (under another recomputation mode if given)."""
        return self.pricing.prepared_for(config, recompute)

    def counts(self, tp: int, microbatch_size: int, sequence_parallel: bool = True) -> dict[str, SegmentCounts]:
        return self.pricing.counts(tp, microbatch_size, sequence_parallel)

    def features(self, estimate: Estimate) -> dict[str, float]:
        """Features of the calibrated terms for a priced configuration (overheads.py)."""
        return self.pricing.features(estimate)

    def evaluate(self, config: ParallelConfig) -> tuple[Estimate, ShardingResult]:
        """A configuration given by hand, checked, then priced as given."""
        self.check(config)
        return self.pricing.evaluate(config)

    # --- what is checked (constraints.ConfigChecks) and enumerated (enumerate.Candidates) -----

    def check(self, config: ParallelConfig) -> None:
        self.checks.check(config)

    def check_cp(self, cp: int) -> None:
        """A context-parallel degree the model's sequence can be split into (2 cp chunks)."""
        self.checks.check_cp(cp)

    def ep_options(self, tp: int, dp: int, microbatch_size: int, sequence_parallel: bool = True) -> list[int]:
        """Expert-parallel degrees > 1 this model allows on a dp x tp mesh (none without expert ops)."""
        return self.pricing.ep_options(tp, dp, microbatch_size, sequence_parallel)

    def virtual_stages(self, pp: int, constraints: Constraints) -> list[int]:
        return self.candidates.virtual_stages(pp, constraints)

    # --- search ------------------------------------------------------------------------------

    def search(self, constraints: Constraints = Constraints(), *, keep: int = 5) -> SearchResult:
        started = time.perf_counter()
        self.checks.check_offload_constraints(constraints)
        passes = [constraints.offload] if constraints.offload is not None else [False]
        if constraints.offload is None and self.step_model.can_offload and self.cluster.device_kind != "cpu":
            passes.append(True)  # only if nothing fits without (on a CPU the host memory is the device's)
        leanest = None  # over the passes: the offload pass may price nothing (it needs pp = 1)
        for offload in passes:
            found = self._search_pass(constraints, keep, offload)
            if found.ranked:
                break
            if found.least_memory is not None and (leanest is None or found.least_memory[0] < leanest[0]):
                leanest = found.least_memory
        if not found.ranked:
            raise self._infeasible(leanest[1] if leanest else None, constraints)
        ranked = [estimate for _, estimate in found.ranked]
        best = ranked[0]
        return SearchResult(best=best, sharding=self.sharding(best.config.tp, best.config.microbatch_size,
                                                             best.config.sequence_parallel, best.config.folds_experts),
                            num_configs=found.count,
                            num_sharding_solves=len(set(self.pricing.solves) | found.sharding_keys),
                            search_time_s=time.perf_counter() - started, ranked=ranked)

    def _search_pass(self, constraints: Constraints, keep: int, offload: bool) -> Found:
        """The best `keep` fitting estimates, configurations priced, the leanest estimate."""
        meshes = [mesh for mesh in self.candidates.meshes(constraints) if not offload or mesh[1] == 1]
        jobs = search_jobs(self.options.jobs, meshes)
        if jobs > 1:
            return search_in_workers(self, meshes, constraints, keep, offload, jobs)
        return self.search_meshes(list(enumerate(meshes)), constraints, keep, offload, Board(keep))

    def search_meshes(self, meshes: list[tuple[int, MeshDegrees]], constraints: Constraints,
                      keep: int, offload: bool, board: Board) -> Found:
        """Prices the configurations of the numbered meshes (tp, pp, dp, cp), in order; `board`
        holds the `keep` best step times found so far (here or, searching in workers, by any of
        them): what a configuration must beat to be priced."""
        found = Found()
        bound_factor = self.overheads.lower_bound_factor if self.overheads else 1.0
        if self.pricing.fp8 is not None:  # float8 matmuls may make a step faster than its bf16 bound
            bound_factor *= self.pricing.fp8.lower_bound_factor
        for index, (tp, pp, dp, cp) in self._promising_first(meshes, constraints, offload):
            for microbatch in self.candidates.microbatches(dp, constraints):
                self.progress(f"planning: tp={tp} pp={pp} dp={dp}{f' cp={cp}' if cp > 1 else ''} microbatch={microbatch}"
                              + (" (optimizer offload)" if offload else ""))
                fitted_any = False
                fitted_lighter: dict[tuple, float] = {}
                for config in self.candidates.configs(tp, pp, dp, microbatch, constraints, cp, offload=offload):
                    prepared = self.pricing.prepared_for(config)
                    work_s = prepared.work_s
                    rest = (config.schedule, config.virtual_stages, config.ep, config.zero_stage)
                    if work_s > fitted_lighter.get(rest, float("inf")):
                        continue  # a lighter mode fits with less work: this one only adds recomputation
                    cutoff = board.cutoff_s()
                    if lower_bound_s(self.pricing.least_work(config), config) * bound_factor > cutoff:
                        fitted_any = True  # not priced, but a faster one is known: keep looking
                        continue
                    # Once a configuration fits, one that does not is not priced: only the
                    # leanest of them matters, for the message when none fits.
                    staged = self.step_model.stages(prepared, config, self.pricing.lighter(config),
                                                    cutoff_s=cutoff / bound_factor, price_unfit=not found.ranked)
                    if staged is None:
                        continue
                    found.count += 1
                    if staged.bound_s * bound_factor > cutoff:
                        fitted_any = True  # its slowest stage alone is slower than the ones kept
                        continue
                    if not staged.stages:
                        continue  # does not fit
                    estimate = self.pricing.calibrated(self.step_model.assemble(staged.stages, staged.fits, config))
                    found.order += 1
                    key = (estimate.peak_memory_bytes, index, found.order)
                    if found.least_memory is None or key < found.least_memory[0]:
                        found.least_memory = (key, estimate)
                    if estimate.fits:
                        fitted_any = True
                        fitted_lighter.setdefault(rest, work_s)
                        found.add((estimate.step_time_s, estimate.peak_memory_bytes, index, found.order), estimate,
                                  keep)
                        board.offer(estimate.step_time_s)
                if not fitted_any and constraints.microbatch_size is None:
                    break  # larger microbatches need more memory still
        return found

    def _promising_first(self, meshes: list[tuple[int, MeshDegrees]], constraints: Constraints, offload: bool):
        """The meshes by the least lower bound of their first microbatch's configurations (which
        the search prices in any case): fast plans found early make the cutoff tight early. The
        order changes what is priced, not the ranking (ties go by mesh number, Found)."""
        def least(mesh) -> float:
            tp, pp, dp, cp = mesh
            microbatches = self.candidates.microbatches(dp, constraints)
            if not microbatches:
                return float("inf")
            return min((lower_bound_s(self.pricing.least_work(config), config)
                        for config in self.candidates.configs(tp, pp, dp, microbatches[0], constraints, cp,
                                                              offload=offload)),
                       default=float("inf"))
        return sorted(meshes, key=lambda numbered: (least(numbered[1]), numbered[0]))

    def _infeasible(self, least: Estimate | None, constraints: Constraints) -> InfeasiblePlanError:
        budget = self.step_model.memory_budget_bytes
        if least is None:
            return InfeasiblePlanError(self.candidates.no_config_message(constraints))
        found = f"the model does not fit: the leanest configuration found ({least.config.describe()}) needs "
        advice = "Use more devices, devices with more memory, or relax the constraints."
        host_bytes = sum(least.host_memory_bytes.values())
        if least.config.offload and least.peak_memory_bytes <= budget \
                and host_bytes > self.step_model.host_memory_bytes:
            parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in least.host_memory_bytes.items() if size)
            return InfeasiblePlanError(
                f"{found}{human_bytes(least.peak_memory_bytes)} per device, which fits, but with its optimizer "
                f"states offloaded {human_bytes(host_bytes)} of host memory per device ({parts}), more than the "
                f"{human_bytes(self.step_model.host_memory_bytes)} the cluster's nodes have per device. {advice}")
        parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in least.memory_bytes.items() if size)
        return InfeasiblePlanError(
            f"{found}{human_bytes(least.peak_memory_bytes)} per device ({parts}), more than the "
            f"{human_bytes(budget)} usable of {human_bytes(self.cluster.device.memory_bytes)}. {advice}")


def _allocator(cluster, options: SearchOptions) -> AllocatorModel:
    if options.allocator is not None:
        return options.allocator
    return NO_OVERHEAD if cluster.device_kind == "cpu" else DEFAULT_ALLOCATOR


def _shared_params(graph: OpGraph) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """(numel, indices of the segments that read it) of each trainable parameter read by more
    than one segment: a tied embedding and head (first and last), T5's shared embedding (the
    encoder's, the decoder's and the head's)."""
    if len(graph.segments) < 2:
        return ()
    index_of = {name: position for position, segment in enumerate(graph.segments) for name in segment.nodes}
    shared = []
    for param in graph.params:
        readers = sorted({index_of[user] for user in graph.consumers.get(param.node, ()) if user in index_of})
        if param.trainable and len(readers) > 1:
            shared.append((float(param.meta.numel), tuple(readers)))
    return tuple(shared)


def with_constraints(config: ParallelConfig, **changes) -> ParallelConfig:
    return replace(config, **changes)

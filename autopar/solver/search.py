"""Whole-cluster search: mesh shape, microbatching, schedule, recomputation and ZeRO stage.

For every factorisation of the devices into pp x dp x cp x tp (tensor parallel inside a node
unless constrained otherwise; context parallelism only for models whose sequence can be split,
solver/context_parallel.py), every microbatch size dividing the per-replica batch, the 1F1B,
interleaved and zero-bubble (zb1p, zbv) schedules, each recomputation mode and ZeRO stage, and for a model with expert
matmuls every expert-parallel degree dividing dp (experts sharded over ep of the dp ranks,
solver/experts.py; with ZeRO-0 and cp=1, what codegen runs it with), the step model (step_model.py)
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
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autopar.solver.condense import condense, expand_segments
from autopar.solver.constraints import GATHERS_WITHOUT_SP, ZERO3_WITH_ZERO_BUBBLE, Constraints
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import OpGraph
from autopar.validation import human_bytes
from autopar.mesh import Mesh
from autopar.solver.evaluate import SegmentCost
from autopar.solver.context_parallel import attention_costs, sequence_length, split_compute, split_sequence
from autopar.solver.experts import ExpertPricing, ep_degrees, find_expert_ops
from autopar.solver.overheads import Overheads, SegmentCounts, segment_counts, step_features
from autopar.solver.sharding import ShardingOptions, ShardingResult, cost_context, solve_sharding
from autopar.strategies.attention import context_parallel_blocker
from autopar.solver.step_model import (RECOMPUTE_MODES, SCHEDULES, ZERO_BUBBLE_SCHEDULES, Estimate, ParallelConfig, PreparedSegments,
                                       StepModel)
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
    """How context parallelism moves keys and values: "all_gather" (Llama 3's) or "ring"."""
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

JOBS_ENV = "AUTOPAR_JOBS"
"""Environment variable: processes of a search whose options leave `jobs` unset."""
MAX_DEFAULT_JOBS = 8
MIN_MESHES_PER_JOB = 8
"""A search of fewer meshes per process runs in one: forking costs more than it saves."""


def search_jobs(jobs: int | None, meshes: list) -> int:
    """How many processes price the meshes: `jobs` (or $AUTOPAR_JOBS) as asked, else the usable
    cores up to MAX_DEFAULT_JOBS, fewer for a small search, and 1 while other Python threads run;
    1 where os.fork is unavailable."""
    import multiprocessing
    import os
    import threading

    if jobs is None and os.environ.get(JOBS_ENV, "").strip():
        jobs = _jobs_from_env(os.environ[JOBS_ENV])
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1  # no fork (Windows): the workers could not inherit the captured graph
    if jobs is None and threading.active_count() > 1:
        return 1  # forking a multi-threaded process (a notebook's kernel) may deadlock its children
    if jobs is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")  # torchrun: the node's processes share the cores
        cores //= max(1, int(local)) if local.isdigit() else 1
        jobs = min(cores, MAX_DEFAULT_JOBS, len(meshes) // MIN_MESHES_PER_JOB)
    return max(1, min(jobs, len(meshes)))


def check_jobs_env() -> None:
    """A bad $AUTOPAR_JOBS raises ConfigError now (before a capture that may take seconds)."""
    import os

    if os.environ.get(JOBS_ENV, "").strip():
        _jobs_from_env(os.environ[JOBS_ENV])


def _jobs_from_env(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ConfigError(f"{JOBS_ENV}={text!r}: give the number of processes that price configurations, an "
                          f"integer >= 1 (1: search in this process), or unset it")
    return jobs


class Board:
    """The `keep` best step times found so far, fastest first: a configuration whose lower
    bound exceeds the last of them is not priced (in one process; parallel_search.SharedBoard
    is the one its workers share)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.times_s: list[float] = []

    def cutoff_s(self) -> float:
        return self.times_s[self.keep - 1] if len(self.times_s) >= self.keep else float("inf")

    def offer(self, time_s: float) -> None:
        bisect.insort(self.times_s, time_s)
        del self.times_s[self.keep:]


@dataclass
class Found:
    """What a search of some meshes found: the best `keep` fitting estimates by (step time, peak
    memory, mesh number, order found), the configurations priced, the leanest estimate."""

    ranked: list[tuple[tuple, Estimate]] = field(default_factory=list)
    count: int = 0
    least_memory: tuple[tuple, Estimate] | None = None
    """(peak memory, mesh number, order found) and the estimate, fitting or not."""
    order: int = 0
    sharding_keys: set = field(default_factory=set)
    """(tp, microbatch) of the intra-op solves made in workers (none in one process)."""

    def add(self, key: tuple, estimate: Estimate, keep: int) -> None:
        bisect.insort(self.ranked, (key, estimate), key=lambda entry: entry[0])
        del self.ranked[keep:]


class Planner:
    """Plans one captured model on one cluster for one global batch size."""

    def __init__(self, graph: OpGraph, cluster, *, global_batch: int, policy: PrecisionPolicy = BF16_ADAM,
                 precision: str = "bf16", options: SearchOptions = SearchOptions(),
                 progress: Progress | None = None, overheads: Overheads | None = None) -> None:
        if global_batch < 1:
            raise ConfigError(f"global batch must be >= 1, got {global_batch}")
        self.graph = graph
        self.cluster = cluster
        self.global_batch = global_batch
        if options.optimizer is not None:
            policy = replace(policy, optimizer_io_bytes_per_param=adamw_io_bytes_per_param(options.optimizer))
        self.policy = policy
        self.precision = precision
        """Name of the precision policy ("bf16" or "fp32"), recorded in plans."""
        self.options = options
        self.progress = progress or (lambda message: None)
        self.step_model = StepModel(
            devices_per_node=cluster.devices_per_node, compute=ComputeModel(cluster.device, cluster.profile),
            comm=CommModel(cluster), policy=policy,
            memory_budget_bytes=cluster.device.memory_bytes * options.usable_memory_fraction,
            shared_params=_shared_params(graph), allocator=_allocator(cluster, options),
            expert_pricing=options.experts,

            host_link_bytes_per_s=cluster.device.host_link_bytes_per_s,
            host_memory_bandwidth_bytes_per_s=cluster.device.host_memory_bandwidth_bytes_per_s,
            host_memory_bytes=cluster.device.host_memory_bytes)
        self.overheads = overheads
        """Calibrated whole-step terms (overheads.py), or None to price kernels and collectives only."""
        self.condensed = condense(graph)
        self.expert_ops = find_expert_ops(self.condensed)
        """The expert matmuls expert parallelism can split (solver/experts.py)."""
        self._counts: dict[tuple[int, int, bool], dict[str, SegmentCounts]] = {}
        self._sharding: dict[tuple[int, int, bool], ShardingResult] = {}
        """Intra-op solves by tp_key (tp, microbatch, sequence parallelism allowed)."""
        self._prepared: dict[tuple, PreparedSegments] = {}
        self._costs: dict[tuple[int, int, bool, int], list[SegmentCost]] = {}
        """segment_costs by (tp, microbatch, sequence parallel, cp): each recomputation mode reads them again."""
        self.sequence_length = sequence_length(graph)
        self.cp_blocker = context_parallel_blocker(graph, self.sequence_length)
        """Why the sequence cannot be split over cp ranks ("" when it can)."""

    @property
    def num_blocks(self) -> int:
        return sum(1 for segment in self.graph.segments if segment.block_group is not None)

    @staticmethod
    def tp_key(tp: int, microbatch_size: int, sequence_parallel: bool = True) -> tuple[int, int, bool]:
        """What an intra-op solve depends on: (tp, microbatch, sequence parallelism allowed); with
        tp = 1 there is nothing to shard by sequence, and both flags share one solve."""
        return tp, microbatch_size, bool(sequence_parallel) or tp == 1

    def sharding(self, tp: int, microbatch_size: int, sequence_parallel: bool = True) -> ShardingResult:
        """Intra-op solution on a tp mesh at one microbatch size (of the condensed graph)."""
        key = self.tp_key(tp, microbatch_size, sequence_parallel)
        if key not in self._sharding:
            graph = self.condensed.with_batch(microbatch_size) if self.graph.batch_dynamic else self.condensed
            mesh = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=self.cluster.devices_per_node)
            ctx = cost_context(mesh, self.cluster, self.policy)
            options = replace(self.options.sharding, sequence_parallel=key[2])
            self._sharding[key] = solve_sharding(graph, mesh, self.cluster, options, ctx=ctx)
        return self._sharding[key]

    def strategies(self, tp: int, microbatch_size: int, sequence_parallel: bool = True) -> dict:
        """Strategy of every node of the full graph (dropped blocks take their stand-in's)."""
        kept = self.sharding(tp, microbatch_size, sequence_parallel).strategies
        found = dict(kept)
        for name, stand_in in self.condensed.stand_ins.items():
            if stand_in in kept:
                found[name] = kept[stand_in]
        return found

    def segment_costs(self, tp: int, microbatch_size: int, cp: int = 1,
                      sequence_parallel: bool = True) -> list[SegmentCost]:
        """Per segment of the full model (identical blocks share block 1's cost); with cp > 1 per
        rank of a sequence split over cp ranks."""
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (cp,)
        if key not in self._costs:
            per_block = list(self.sharding(tp, microbatch_size, sequence_parallel).segments) if cp == 1 else \
                self._sequence_split(tp, microbatch_size, cp, sequence_parallel)
            self._costs[key] = expand_segments(self.graph, self.condensed, per_block)
        return list(self._costs[key])

    def _sequence_split(self, tp: int, microbatch_size: int, cp: int, sequence_parallel: bool) -> list[SegmentCost]:
        sharding = self.sharding(tp, microbatch_size, sequence_parallel)
        graph = self.condensed.with_batch(microbatch_size) if self.graph.batch_dynamic else self.condensed
        ctx = cost_context(sharding.mesh, self.cluster, self.policy)
        attentions = attention_costs(graph, sharding.strategies, ctx)
        compute = split_compute(graph, sharding.strategies, ctx, cp)
        return [split_sequence(segment, attentions.get(segment.name, []), cp=cp, tp=tp, comm=self.step_model.comm,
                               devices_per_node=self.cluster.devices_per_node, method=self.options.cp_kv_exchange,
                               compute=compute.get(segment.name))
                for segment in sharding.segments]

    def prepared(self, tp: int, microbatch_size: int, recompute: str, cp: int = 1,
                 sequence_parallel: bool = True) -> PreparedSegments:
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (recompute, cp)
        if key not in self._prepared:
            self._prepared[key] = PreparedSegments.build(
                self.segment_costs(tp, microbatch_size, cp, sequence_parallel), recompute)
        return self._prepared[key]

    def prepared_for(self, config: ParallelConfig, recompute: str | None = None) -> PreparedSegments:
        """The prepared segments of a configuration (under another recomputation mode if given)."""
        return self.prepared(config.tp, config.microbatch_size, recompute or config.recompute, config.cp,
                             config.sequence_parallel)

    def _least_work(self, config: ParallelConfig) -> PreparedSegments:
        """What a lower bound on the configuration's time may count: its own mode's segments, or
        under pipelining the lightest mode's (stages that fit may recompute less, _lighter)."""
        if config.pp == 1:
            return self.prepared_for(config)
        return self.prepared_for(config, RECOMPUTE_MODES[0])

    def _lighter(self, config: ParallelConfig) -> dict[str, PreparedSegments]:
        """Cheaper recomputation modes than the configuration's, for stages that can afford them
        ("gathers" only with sequence parallelism: GATHERS_WITHOUT_SP)."""
        if config.pp == 1:
            return {}
        modes = [mode for mode in RECOMPUTE_MODES[:RECOMPUTE_MODES.index(config.recompute)]
                 if mode != "gathers" or config.sequence_parallel]
        return {mode: self.prepared_for(config, mode) for mode in modes}

    def counts(self, tp: int, microbatch_size: int, sequence_parallel: bool = True) -> dict[str, SegmentCounts]:
        key = self.tp_key(tp, microbatch_size, sequence_parallel)
        if key not in self._counts:
            self._counts[key] = segment_counts(self.graph, self.segment_costs(tp, microbatch_size,
                                                                              sequence_parallel=sequence_parallel))
        return self._counts[key]

    def features(self, estimate: Estimate) -> dict[str, float]:
        """Features of the calibrated terms for a priced configuration (overheads.py)."""
        config = estimate.config
        cores = self.overheads.calibration.num_cores if self.overheads else 0
        return step_features(estimate, self.counts(config.tp, config.microbatch_size, config.sequence_parallel),
                             self.step_model,
                             processes_per_node=self.cluster.devices_per_node, num_cores=cores or _cpu_cores(self))

    def _calibrated(self, estimate: Estimate | None) -> Estimate | None:
        if estimate is None or self.overheads is None:
            return estimate
        return self.overheads.apply(estimate, self.features(estimate))

    # --- evaluate one configuration ----------------------------------------------------------

    def evaluate(self, config: ParallelConfig) -> tuple[Estimate, ShardingResult]:
        self.check(config)
        sharding = self.sharding(config.tp, config.microbatch_size, config.sequence_parallel)
        # A configuration given by hand is priced as given: its recompute mode on every stage.
        estimate = self.step_model.estimate(self.prepared_for(config), config)
        estimate = self._calibrated(estimate)
        if estimate is None:
            raise ConfigError(f"{config.describe()}: the model has {len(self.graph.segments)} segments, too few "
                              f"for {config.pp * config.virtual_stages} pipeline chunks")
        return estimate, sharding

    def check(self, config: ParallelConfig) -> None:
        devices = self.cluster.num_devices
        if config.num_devices != devices:
            cp = f" x cp={config.cp}" if config.cp > 1 else ""
            raise ConfigError(f"dp x tp x pp{' x cp' if cp else ''} = {config.dp} x {config.tp} x {config.pp}{cp} = "
                              f"{config.num_devices}, but the cluster has {devices} devices")
        if config.cp > 1:
            self.check_cp(config.cp)
        if config.microbatch_size * config.num_microbatches * config.dp != self.global_batch:
            raise ConfigError(f"global batch {self.global_batch} is not dp x microbatch size x microbatches = "
                              f"{config.dp} x {config.microbatch_size} x {config.num_microbatches}")
        if config.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule '{config.schedule}'; use one of {', '.join(SCHEDULES)}")
        if config.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"unknown recompute mode '{config.recompute}'; use one of {', '.join(RECOMPUTE_MODES)}")
        if config.recompute == "gathers" and not config.sequence_parallel:
            raise ConfigError(GATHERS_WITHOUT_SP)
        if config.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {config.zero_stage}")
        if config.schedule == "interleaved" and (config.virtual_stages < 2 or config.pp < 2):
            raise ConfigError("the interleaved schedule needs pp >= 2 and at least 2 model chunks per device")
        if config.schedule in ZERO_BUBBLE_SCHEDULES and config.pp < 2:
            raise ConfigError(f"the {config.schedule} schedule is a pipeline schedule: it needs pp >= 2")
        if config.schedule in ZERO_BUBBLE_SCHEDULES and config.zero_stage == 3:
            raise ConfigError(f"schedule {config.schedule} with zero_stage 3: {ZERO3_WITH_ZERO_BUBBLE}")
        if config.schedule == "zbv" and config.virtual_stages != 2:
            raise ConfigError(f"the zbv schedule runs exactly 2 model chunks per device (a V), got "
                              f"virtual_stages={config.virtual_stages}; use 2, or the zb1p schedule")
        if not schedule_accepts(config.schedule, config.pp, config.num_microbatches, config.virtual_stages):
            raise ConfigError(f"{config.num_microbatches} microbatches cannot fill a {config.schedule} pipeline of "
                              f"{config.pp} stages: 1F1B and the zero-bubble schedules need at least as many "
                              "microbatches as stages, the interleaved schedule a multiple of them; use a smaller "
                              "microbatch or a larger batch")
        self._check_ep(config)
        self._check_offload(config)
        if not self.graph.batch_dynamic and config.microbatch_size != self.graph.batch_size:
            raise ConfigError(f"the model was captured with a fixed batch of {self.graph.batch_size}; "
                              f"microbatch size {config.microbatch_size} cannot be priced")

    def ep_options(self, tp: int, dp: int, microbatch_size: int, sequence_parallel: bool = True) -> list[int]:
        """Expert-parallel degrees > 1 this model allows on a dp x tp mesh (none without expert ops)."""
        if not self.expert_ops or dp < 2:
            return []
        strategies = self.sharding(tp, microbatch_size, sequence_parallel).strategies
        return ep_degrees(self.condensed, self.expert_ops, strategies, dp, tp)

    def _check_ep(self, config: ParallelConfig) -> None:
        if config.ep == 1:
            return
        if config.ep < 1 or config.dp % config.ep:
            raise ConfigError(f"ep={config.ep} must divide dp={config.dp}: expert parallelism splits the experts over "
                              "groups of ep data-parallel ranks")
        if config.zero_stage != 0:
            raise ConfigError(f"ep={config.ep} runs with ZeRO-0 only (FSDP of expert-sharded weights is not built): "
                              "use zero_stage=0 or ep=1")
        if not self.expert_ops:
            raise ConfigError(f"ep={config.ep}: the model has no expert matmuls that expert parallelism can split "
                              "(an einsum, bmm or grouped matmul over a 3-D expert weight read only by such ops); use ep=1")
        if config.ep not in self.ep_options(config.tp, config.dp, config.microbatch_size, config.sequence_parallel):
            counts = sorted({op.num_experts for op in self.expert_ops})
            raise ConfigError(f"ep={config.ep} with tp={config.tp}: the experts ({counts} per layer, split over tp where "
                              f"the plan shards them) do not split evenly into {config.ep} groups, or the "
                              "tensor-parallel plan leaves the expert tokens partial; use another ep or tp")

    def check_cp(self, cp: int) -> None:
        """A context-parallel degree the model's sequence can be split into (2 cp chunks)."""
        if cp < 1:
            raise ConfigError(f"cp must be >= 1, got {cp}")
        if cp == 1:
            return
        if self.cp_blocker:
            raise ConfigError(f"cp={cp}: context parallelism cannot split this model's sequence: {self.cp_blocker}; "
                              "plan with cp=1")
        if self.sequence_length % (2 * cp):
            raise ConfigError(f"cp={cp}: the sequence of {self.sequence_length} tokens does not split into 2 x cp = "
                              f"{2 * cp} equal chunks (load-balanced causal attention); choose a cp dividing "
                              f"{self.sequence_length // 2}")

    def _cps(self, rest: int, constraints: Constraints) -> list[int]:
        """Context-parallel degrees dividing `rest` devices (see SearchOptions.min_tokens_per_cp_rank)."""
        if constraints.cp:
            self.check_cp(constraints.cp)
            return [constraints.cp] if rest % constraints.cp == 0 else []
        if self.cp_blocker:
            return [1]
        most = self.sequence_length // max(1, self.options.min_tokens_per_cp_rank)
        return [1] + [c for c in _divisors(rest) if 1 < c <= most and self.sequence_length % (2 * c) == 0]

    def _check_offload(self, config: ParallelConfig) -> None:
        if not config.offload:
            return
        if not self.step_model.can_offload:
            raise ConfigError(f"optimizer offload needs the host link and host memory bandwidth of the device; "
                              f"{self.cluster.device.name} has none set: set host_link_gbs and "
                              "host_memory_bandwidth_gbs in the cluster file's [device] table, or drop offload")
        if config.zero_stage != 3 or config.pp != 1:
            raise ConfigError(f"optimizer offload runs with ZeRO-3 and no pipeline (FSDP2 CPUOffloadPolicy keeps "
                              f"parameters sharded in host memory between uses), got zero_stage={config.zero_stage} "
                              f"pp={config.pp}: use zero_stage=3 and pp=1, or drop offload")

    # --- search ------------------------------------------------------------------------------

    def search(self, constraints: Constraints = Constraints(), *, keep: int = 5) -> SearchResult:
        started = time.perf_counter()
        if constraints.offload:
            if constraints.zero_stage not in (None, 3) or constraints.pp not in (None, 1):
                raise ConfigError(f"optimizer offload runs with ZeRO-3 and no pipeline, but the constraints fix "
                                  f"zero_stage={constraints.zero_stage} pp={constraints.pp}: drop them or the offload")
            if not self.step_model.can_offload:
                raise ConfigError(f"optimizer offload needs the host link and host memory bandwidth of the device; "
                                  f"{self.cluster.device.name} has none set: set host_link_gbs and "
                                  "host_memory_bandwidth_gbs in the cluster file's [device] table")
        passes = [constraints.offload] if constraints.offload is not None else [False]
        if constraints.offload is None and self.step_model.can_offload and self.cluster.device_kind != "cpu":
            passes.append(True)  # only if nothing fits without (on a CPU the host memory is the device's)
        for offload in passes:
            found = self._search_pass(constraints, keep, offload)
            if found.ranked:
                break
        if not found.ranked:
            raise self._infeasible(found.least_memory[1] if found.least_memory else None, constraints)
        ranked = [estimate for _, estimate in found.ranked]
        best = ranked[0]
        return SearchResult(best=best, sharding=self.sharding(best.config.tp, best.config.microbatch_size,
                                                             best.config.sequence_parallel),
                            num_configs=found.count, num_sharding_solves=len(set(self._sharding) | found.sharding_keys),
                            search_time_s=time.perf_counter() - started, ranked=ranked)

    def _search_pass(self, constraints: Constraints, keep: int, offload: bool) -> "Found":
        """The best `keep` fitting estimates, configurations priced, the leanest estimate."""
        meshes = [mesh for mesh in self._meshes(constraints) if not offload or mesh[1] == 1]
        jobs = search_jobs(self.options.jobs, meshes)
        if jobs > 1:
            from autopar.solver.parallel_search import search_in_workers

            found = search_in_workers(self, meshes, constraints, keep, offload, jobs)
        else:
            found = self.search_meshes(list(enumerate(meshes)), constraints, keep, offload, Board(keep))
        return found

    def search_meshes(self, meshes: list[tuple[int, tuple[int, int, int, int]]], constraints: Constraints,
                      keep: int, offload: bool, board: "Board") -> "Found":
        """Prices the configurations of the numbered meshes (tp, pp, dp, cp), in order; `board`
        holds the `keep` best step times found so far (here or, searching in workers, by any of
        them): what a configuration must beat to be priced."""
        found = Found()
        bound_factor = self.overheads.lower_bound_factor if self.overheads else 1.0
        for index, (tp, pp, dp, cp) in self._promising_first(meshes, constraints, offload):
            for microbatch in self._microbatches(dp, constraints):
                self.progress(f"planning: tp={tp} pp={pp} dp={dp}{f' cp={cp}' if cp > 1 else ''} microbatch={microbatch}"
                              + (" (optimizer offload)" if offload else ""))
                fitted_any = False
                fitted_lighter: dict[tuple, float] = {}
                for config in self._configs(tp, pp, dp, microbatch, constraints, cp, offload=offload):
                    prepared = self.prepared_for(config)
                    work_s = prepared.work_s
                    rest = (config.schedule, config.virtual_stages, config.ep, config.zero_stage)
                    if work_s > fitted_lighter.get(rest, float("inf")):
                        continue  # a lighter mode fits with less work: this one only adds recomputation
                    cutoff = board.cutoff_s()
                    if _lower_bound_s(self._least_work(config), config) * bound_factor > cutoff:
                        fitted_any = True  # not priced, but a faster one is known: keep looking
                        continue
                    # Once a configuration fits, one that does not is not priced: only the
                    # leanest of them matters, for the message when none fits.
                    staged = self.step_model.stages(prepared, config, self._lighter(config),
                                                    cutoff_s=cutoff / bound_factor, price_unfit=not found.ranked)
                    if staged is None:
                        continue
                    found.count += 1
                    if staged.bound_s * bound_factor > cutoff:
                        fitted_any = True  # its slowest stage alone is slower than the ones kept
                        continue
                    if not staged.stages:
                        continue  # does not fit
                    estimate = self._calibrated(self.step_model.assemble(staged.stages, staged.fits, config))
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

    def _promising_first(self, meshes: list[tuple[int, tuple]], constraints: Constraints, offload: bool):
        """The meshes by the least lower bound of their first microbatch's configurations (which
        the search prices in any case): fast plans found early make the cutoff tight early. The
        order changes what is priced, not the ranking (ties go by mesh number, Found)."""
        def least(mesh) -> float:
            tp, pp, dp, cp = mesh
            microbatches = self._microbatches(dp, constraints)
            if not microbatches:
                return float("inf")
            return min((_lower_bound_s(self._least_work(config), config)
                        for config in self._configs(tp, pp, dp, microbatches[0], constraints, cp, offload=offload)),
                       default=float("inf"))
        return sorted(meshes, key=lambda numbered: (least(numbered[1]), numbered[0]))

    def _meshes(self, constraints: Constraints):
        devices = self.cluster.num_devices
        tps = [constraints.tp] if constraints.tp else [t for t in _divisors(devices) if t <= self.cluster.devices_per_node]
        found = []
        for tp in tps:
            if devices % tp:
                raise ConfigError(f"tp={tp} does not divide the {devices} devices of the cluster")
            rest = devices // tp
            pps = [constraints.pp] if constraints.pp else [p for p in _divisors(rest) if p <= len(self.graph.segments)]
            for pp in pps:
                if rest % pp:
                    if constraints.tp:
                        raise ConfigError(f"tp x pp = {tp * pp} does not divide the {devices} devices of the cluster")
                    continue  # this tp leaves no room for the requested pp; another tp may
                for cp in self._cps(rest // pp, constraints):
                    dp = rest // (pp * cp)
                    if constraints.dp and dp != constraints.dp:
                        continue
                    if self.global_batch % dp == 0:
                        found.append((tp, pp, dp, cp))
        if not found:
            raise ConfigError(self._no_mesh_message(constraints))
        return found

    def _no_mesh_message(self, constraints: Constraints) -> str:
        fixed = {k: v for k, v in (("dp", constraints.dp), ("tp", constraints.tp), ("pp", constraints.pp),
                                   ("cp", constraints.cp)) if v}
        return (f"no mesh of {self.cluster.num_devices} devices matches {fixed or 'the cluster'} with a data-parallel "
                f"degree dividing the global batch {self.global_batch}; change the global batch or the constraints")

    def _microbatches(self, dp: int, constraints: Constraints) -> list[int]:
        local = self.global_batch // dp
        if constraints.microbatch_size:
            if local % constraints.microbatch_size:
                raise ConfigError(f"microbatch size {constraints.microbatch_size} does not divide the per-replica "
                                  f"batch {local} (global batch {self.global_batch} / dp {dp})")
            return [constraints.microbatch_size]
        if not self.graph.batch_dynamic:
            return [self.graph.batch_size] if local % self.graph.batch_size == 0 else []
        # Powers of two: what practitioners use, and half the intra-op solves of all divisors.
        return [b for b in _divisors(local) if b <= self.options.max_microbatch_size and b & (b - 1) == 0]

    def _configs(self, tp: int, pp: int, dp: int, microbatch: int, constraints: Constraints, cp: int = 1, *,
                 offload: bool = False):
        m = self.global_batch // (dp * microbatch)
        schedules = self._schedules(pp, constraints)
        sequence_parallel = constraints.sequence_parallel_allowed
        modes = [constraints.recompute] if constraints.recompute else \
            self._distinct_modes(tp, microbatch, cp, sequence_parallel)
        zeros = [constraints.zero_stage] if constraints.zero_stage is not None else \
            ([0] if dp * cp == 1 else [0, 1, 2, 3])
        if constraints.zero_stage is None and pp > 1 and self.policy.dp_reduce_bytes >= self.policy.grad_bytes:
            # Under pipelining ZeRO-2 reduces gradients once, in the last microbatch, as ZeRO-1
            # does, and accumulates them unsharded until then: ZeRO-1's time, no less memory.
            zeros = [zero for zero in zeros if zero != 2]
        if offload:
            zeros = [zero for zero in zeros if zero == 3] if constraints.zero_stage is not None else [3]
        if constraints.ep and constraints.ep > 1:
            if constraints.zero_stage or not self.expert_ops:  # wrong for every mesh: say why now
                self._check_ep(ParallelConfig(dp=constraints.ep, tp=tp, pp=pp, microbatch_size=microbatch,
                                              num_microbatches=m, zero_stage=constraints.zero_stage or 0,
                                              ep=constraints.ep, sequence_parallel=sequence_parallel))
            eps = [constraints.ep] if cp == 1 and constraints.ep in self.ep_options(tp, dp, microbatch,
                                                                                    sequence_parallel) else []
        elif constraints.ep == 1 or cp > 1:  # codegen runs ep with cp = 1 only
            eps = [1]
        else:
            eps = [1] + self.ep_options(tp, dp, microbatch, sequence_parallel)
        if offload:
            eps = [1]
        for schedule, virtual in schedules:
            if not schedule_accepts(schedule, pp, m, virtual):
                continue
            for recompute in modes:
                for ep in eps:
                    for zero in (zeros if ep == 1 else [0]):
                        if zero == 3 and schedule in ZERO_BUBBLE_SCHEDULES:
                            continue  # ZERO3_WITH_ZERO_BUBBLE
                        yield ParallelConfig(dp=dp, tp=tp, pp=pp, microbatch_size=microbatch, num_microbatches=m,
                                             schedule=schedule, virtual_stages=virtual, recompute=recompute,
                                             zero_stage=zero, ep=ep, cp=cp, offload=offload,
                                             sequence_parallel=sequence_parallel)

    def _distinct_modes(self, tp: int, microbatch: int, cp: int = 1, sequence_parallel: bool = True) -> list[str]:
        """Recomputation modes that price differently from every lighter one (without tensor
        parallelism "gathers" is "none": nothing is gathered). Without sequence parallelism
        "gathers" is not a mode at all (GATHERS_WITHOUT_SP)."""
        distinct: list[str] = []
        for mode in RECOMPUTE_MODES:
            if mode == "gathers" and not sequence_parallel:
                continue
            prepared = self.prepared(tp, microbatch, mode, cp, sequence_parallel)
            if not any(prepared.same_as(self.prepared(tp, microbatch, kept, cp, sequence_parallel))
                       for kept in distinct):
                distinct.append(mode)
        return distinct

    def _schedules(self, pp: int, constraints: Constraints) -> list[tuple[str, int]]:
        virtual = self.virtual_stages(pp, constraints)
        interleavings = virtual or self._interleavings(pp)
        zbv = [("zbv", 2)] if 2 * pp <= len(self.graph.segments) else []
        if constraints.schedule:
            if constraints.schedule == "interleaved":
                if virtual and virtual[0] < 2:
                    raise ConfigError(f"the interleaved schedule runs 2 or more model chunks per device, but the "
                                      f"constraints give {virtual[0]}: ask for more virtual stages (or fewer "
                                      "layers per virtual stage), or use the 1f1b schedule")
                return [("interleaved", v) for v in interleavings]
            if constraints.schedule == "zb1p":
                return [("zb1p", v) for v in (virtual or [1] + interleavings)]
            if constraints.schedule == "zbv":
                if constraints.virtual_stages not in (None, 2):
                    raise ConfigError(f"the zbv schedule runs exactly 2 model chunks per device (a V), got "
                                      f"virtual_stages={constraints.virtual_stages}; use 2, or the zb1p schedule")
                return zbv
            return [(constraints.schedule, 1)]
        if pp == 1:
            return [("1f1b", 1)]
        # Zero-bubble: ZB-H1 (zb1p, one chunk) and ZB-V; zb1p over several chunks only when asked
        # for (--schedule zb1p): searching every interleaving twice tripled the search's time.
        return [("1f1b", 1)] + [("interleaved", v) for v in interleavings] + [("zb1p", 1)] + zbv

    def virtual_stages(self, pp: int, constraints: Constraints) -> list[int]:
        if constraints.virtual_stages:
            return [constraints.virtual_stages]
        if constraints.layers_per_virtual_stage:
            # Chunks need not be equal: the stage partition (pipeline.py) may give the first and
            # last chunks fewer layers (they also hold the embedding and the head), as Llama 3's
            # 126 layers on 16 stages did. What must hold is at least one layer per chunk.
            # So a chunk may differ from the asked size by less than one layer on average, no more.
            layers = constraints.layers_per_virtual_stage
            virtual = max(round(self.num_blocks / (pp * layers)), 1)
            if abs(self.num_blocks / (pp * virtual) - layers) >= 1 or pp * virtual > len(self.graph.segments):
                raise ConfigError(f"{self.num_blocks} layers on {pp} stages cannot be cut into chunks of {layers} "
                                  f"layers (the nearest is {virtual} chunk(s) per stage of about "
                                  f"{self.num_blocks / (pp * virtual):.3g} layers): ask for a size that divides "
                                  f"the {self.num_blocks // pp} layers a stage holds, or give virtual_stages")
            return [virtual]
        return []

    def _interleavings(self, pp: int) -> list[int]:
        """Chunks per device with at least two layers per chunk on average (uneven chunks allowed)."""
        return [v for v in (2, 3, 4) if pp and self.num_blocks >= 2 * pp * v]

    def _infeasible(self, least: Estimate | None, constraints: Constraints) -> InfeasiblePlanError:
        budget = self.step_model.memory_budget_bytes
        if least is None:
            return InfeasiblePlanError(self._no_config_message(constraints))
        parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in least.memory_bytes.items() if size)
        return InfeasiblePlanError(
            f"the model does not fit: the leanest configuration found ({least.config.describe()}) needs "
            f"{human_bytes(least.peak_memory_bytes)} per device ({parts}), more than the "
            f"{human_bytes(budget)} usable of {human_bytes(self.cluster.device.memory_bytes)}. "
            "Use more devices, devices with more memory, or relax the constraints.")


    def _no_config_message(self, constraints: Constraints) -> str:
        """Why no configuration was left to price, in the terms of the constraints given."""
        fixed = ", ".join(f"{name}={value}" for name, value in vars(constraints).items() if value is not None)
        reasons: list[str] = []
        for tp, pp, dp, _ in self._meshes(constraints):
            most = self.global_batch // dp
            if pp > 1 and constraints.schedule != "gpipe" and most < pp:
                reasons.append(f"pp={pp} with dp={dp} leaves at most {most} microbatches of the global batch "
                               f"{self.global_batch}, fewer than the {pp} stages a 1F1B pipeline must fill "
                               "(use a larger batch, a smaller pp, or --schedule gpipe)")
            if constraints.schedule == "interleaved" and not (self.virtual_stages(pp, constraints)
                                                              or self._interleavings(pp)):
                reasons.append(f"the interleaved schedule needs at least 2 chunks of layers per stage, and the "
                               f"{self.num_blocks} layers do not split into pp={pp} x 2, 3 or 4 chunks")
            if constraints.schedule == "zbv" and 2 * pp > len(self.graph.segments):
                reasons.append(f"the zbv schedule cuts the model into 2 x pp = {2 * pp} chunks, more than its "
                               f"{len(self.graph.segments)} segments")
        if constraints.ep and constraints.ep > 1:
            reasons.append(f"ep={constraints.ep} must divide dp and the experts of every expert layer per "
                           "tensor-parallel rank")
        unique = list(dict.fromkeys(reasons))[:2]
        return (f"no configuration satisfies {fixed or 'the search'}: "
                f"{'; '.join(unique) or 'every candidate was ruled out'}; relax a constraint")


def schedule_accepts(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> bool:
    """What torch.distributed.pipelining's schedules run (and the step model prices): 1F1B and
    ZB-V need m >= p, interleaved (and zb1p with several chunks) a multiple of p; zb1p with one
    chunk m >= p in rounds of equal size (torch: m divisible by max(1, m // p))."""
    if num_stages <= 1 or schedule == "gpipe":
        return True
    m, p = num_microbatches, num_stages
    if schedule == "interleaved" or (schedule == "zb1p" and virtual_stages > 1):
        return m % p == 0
    if schedule == "zb1p":
        return m >= p and m % max(1, m // p) == 0
    return m >= p


def _lower_bound_s(prepared: PreparedSegments, config: ParallelConfig) -> float:
    """No pipeline rank is faster than an even share of the work, nor than the slowest chunk of
    the most balanced cut: t_max >= max(total / p, slowest chunk). 1F1B and GPipe take
    (m - 1) t_max + the sum of the stages (>= total), interleaved (m + (p - 1) / v) t_max, the
    zero-bubble schedules at least m t_max."""
    total = prepared.work_s
    m, p = config.num_microbatches, config.pp
    slowest = max(total / p, prepared.slowest_chunk_s(p * config.chunks_per_device)) if p > 1 else total
    if config.schedule == "interleaved" and p > 1:
        return (m + (p - 1) / config.virtual_stages) * slowest
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        return m * slowest
    return (m - 1) * slowest + total


def _cpu_cores(planner: "Planner") -> int:
    """Cores of this machine for a CPU cluster (its processes share them), else 0 (GPUs)."""
    import os

    return (os.cpu_count() or 1) if planner.cluster.device_kind == "cpu" else 0


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


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

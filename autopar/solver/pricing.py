"""What the search prices: the intra-op solve of a tensor-parallel mesh at one microbatch size
(solved once per (tp, microbatch, sequence parallelism) and reused for every pp, dp and cp), the
per-segment costs and prepared segments built from it (split over cp ranks where the sequence
is), a configuration's estimate under the step model and the calibrated overheads, and the lower
bound that lets the search skip a configuration (search.py says which it skips and why)."""

from __future__ import annotations

from dataclasses import replace

from autopar.cluster import Cluster
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import OpGraph
from autopar.mesh import Mesh
from autopar.solver.condense import expand_segments
from autopar.solver.configs import ZERO_BUBBLE_SCHEDULES, Estimate, ParallelConfig
from autopar.solver.context_parallel import attention_costs, sequence_length, split_compute, split_sequence
from autopar.solver.dtensor_ops import runs_math_attention
from autopar.solver.evaluate import SegmentCost
from autopar.solver.expert_folding import fixed_token_local, read_outside, runs_folded, token_local_region
from autopar.solver.experts import ExpertOp, ep_blocker, ep_degrees
from autopar.solver.fp8_segments import float8_segments
from autopar.solver.overheads import Overheads, SegmentCounts, segment_counts, step_features
from autopar.solver.prepared import PreparedSegments
from autopar.solver.recompute import RECOMPUTE_MODES
from autopar.solver.recompute_blocks import holds_others, is_blocks_mode, recomputed_flags
from autopar.solver.recompute_modules import lighter_modes
from autopar.solver.sharding import ShardingOptions, ShardingResult, cost_context, solve_sharding
from autopar.solver.step_model import StepModel
from cost_model.memory import PrecisionPolicy

TpKey = tuple[int, int, bool]
"""What an intra-op solve depends on: (tp, microbatch, sequence parallelism allowed)."""


class Pricing:
    """The intra-op solves of one planner's model and what is priced from them, cached by tp_key."""

    def __init__(self, *, graph: OpGraph, condensed: OpGraph, cluster: Cluster, policy: PrecisionPolicy,
                 step_model: StepModel, overheads: Overheads | None, sharding_options: ShardingOptions,
                 cp_kv_exchange: str, expert_ops: tuple[ExpertOp, ...]) -> None:
        self.graph = graph
        self.condensed = condensed
        self.cluster = cluster
        self.policy = policy
        self.step_model = step_model
        self.overheads = overheads
        self.sharding_options = sharding_options
        self.cp_kv_exchange = cp_kv_exchange
        """How context parallelism moves keys and values (SearchOptions.cp_kv_exchange)."""
        self.expert_ops = expert_ops
        self.solves: dict[TpKey, ShardingResult] = {}
        """Intra-op solves by tp_key (tp, microbatch, sequence parallelism allowed), + ("folded",)
        for the solves with MoE layers token-local (etp = 1, solver/expert_folding.py)."""
        self.costs: dict[tuple[int, int, bool, int], list[SegmentCost]] = {}
        """segment_costs by (tp, microbatch, sequence parallel, cp): each recomputation mode reads them again."""
        self._prepared: dict[tuple, PreparedSegments] = {}
        self._float8_prepared: dict[tuple, PreparedSegments] = {}
        self._blocks_prepared: dict[tuple, PreparedSegments] = {}
        self._counts: dict[TpKey, dict[str, SegmentCounts]] = {}
        self.fp8 = None
        """Precision "fp8": its terms (fp8_pricing.Fp8Pricing), added to every estimate; else None."""

    @staticmethod
    def tp_key(tp: int, microbatch_size: int, sequence_parallel: bool = True) -> TpKey:
        """What an intra-op solve depends on: (tp, microbatch, sequence parallelism allowed); with
        tp = 1 there is nothing to shard by sequence, and both flags share one solve."""
        return tp, microbatch_size, bool(sequence_parallel) or tp == 1

    # --- intra-op solves and segment costs ---------------------------------------------------

    def sharding(self, tp: int, microbatch_size: int, sequence_parallel: bool = True,
                 folded: bool = False) -> ShardingResult:
        """Intra-op solution on a tp mesh at one microbatch size (of the condensed graph); folded:
        every MoE layer token-local (expert_folding.py: experts unsplit by tp)."""
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (("folded",) if folded else ())
        if key not in self.solves:
            graph = self.condensed.with_batch(microbatch_size) if self.graph.batch_dynamic else self.condensed
            mesh = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=self.cluster.devices_per_node)
            ctx = cost_context(mesh, self.cluster, self.policy)
            options = replace(self.sharding_options, sequence_parallel=key[2])
            fixed = self._token_local(graph) if folded else None
            try:
                self.solves[key] = solve_sharding(graph, mesh, self.cluster, options, ctx=ctx, fixed=fixed)
            except InfeasiblePlanError as error:
                if not folded:
                    raise
                raise ConfigError(f"etp=1 with tp={tp}: the MoE layers cannot run token-local on this model's "
                                  f"tensor-parallel plan ({' '.join(str(error).split()[:40])}...); use etp=tp") from error
        return self.solves[key]

    def _token_local(self, graph: OpGraph) -> dict:
        """The fixed strategies of a folded solve (expert_folding.fixed_token_local)."""
        region = token_local_region(graph, self.expert_ops)
        return fixed_token_local(graph, region, self.expert_ops, sequence_length(graph))

    def folding_blocker(self, tp: int, sequence_parallel: bool, cp: int) -> str:
        """Why the MoE layers cannot be folded (etp = 1) at this tp ("" when they can)."""
        length = sequence_length(self.condensed)
        if not sequence_parallel:
            return "it needs sequence parallelism (each tp rank runs the MoE layers on its own rows)"
        if cp > 1:
            return "it is not priced with context parallelism (cp > 1)"
        if not length or length % tp:
            return f"the sequence of {length} tokens does not split over tp={tp}"
        region = token_local_region(self.condensed, self.expert_ops)
        if not region:
            return ("autopar does not find each MoE layer's token-local region (router, sort, experts, un-sort "
                    "between one residual add and the next)")
        if not runs_folded(self.condensed, self.expert_ops, region):
            return (f"values inside an MoE layer are read outside it ({', '.join(read_outside(self.condensed, region))}"
                    "), and each tp rank holds them for its own tokens only")
        return ""

    def strategies(self, tp: int, microbatch_size: int, sequence_parallel: bool = True, folded: bool = False) -> dict:
        """Strategy of every node of the full graph (dropped blocks take their stand-in's)."""
        kept = self.sharding(tp, microbatch_size, sequence_parallel, folded).strategies
        found = dict(kept)
        for name, stand_in in self.condensed.stand_ins.items():
            if stand_in in kept:
                found[name] = kept[stand_in]
        return found

    def segment_costs(self, tp: int, microbatch_size: int, cp: int = 1,
                      sequence_parallel: bool = True, folded: bool = False) -> list[SegmentCost]:
        """Per segment of the full model (identical blocks share block 1's cost); with cp > 1 per
        rank of a sequence split over cp ranks (folded: cp = 1)."""
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (cp,) + (("folded",) if folded else ())
        if key not in self.costs:
            per_block = list(self.sharding(tp, microbatch_size, sequence_parallel, folded).segments) if cp == 1 else \
                self._sequence_split(tp, microbatch_size, cp, sequence_parallel)
            self.costs[key] = expand_segments(self.graph, self.condensed, per_block)
        return list(self.costs[key])

    def _sequence_split(self, tp: int, microbatch_size: int, cp: int, sequence_parallel: bool) -> list[SegmentCost]:
        sharding = self.sharding(tp, microbatch_size, sequence_parallel)
        graph = self.condensed.with_batch(microbatch_size) if self.graph.batch_dynamic else self.condensed
        ctx = cost_context(sharding.mesh, self.cluster, self.policy)
        attentions = attention_costs(graph, sharding.strategies, ctx, cp=cp, method=self.cp_kv_exchange)
        compute = split_compute(graph, sharding.strategies, ctx, cp)
        return [split_sequence(segment, attentions.get(segment.name, []), cp=cp, tp=tp, comm=self.step_model.comm,
                               devices_per_node=self.cluster.devices_per_node, method=self.cp_kv_exchange,
                               compute=compute.get(segment.name), compute_model=ctx.compute)
                for segment in sharding.segments]

    def ep_options(self, tp: int, dp: int, microbatch_size: int, sequence_parallel: bool = True,
                   folded: bool = False) -> list[int]:
        """Expert-parallel degrees > 1 this model allows on a dp x tp mesh (none without expert ops);
        folded (etp = 1): degrees > 1 dividing tp x dp and the experts, the ep group over tp x dp."""
        if not self.expert_ops or dp * (tp if folded else 1) < 2:
            return []
        strategies = self.sharding(tp, microbatch_size, sequence_parallel, folded).strategies
        return ep_degrees(self.condensed, self.expert_ops, strategies, dp * (tp if folded else 1), 1 if folded else tp)

    def ep_blocker(self, tp: int, dp: int, microbatch_size: int, ep: int, sequence_parallel: bool = True,
                   folded: bool = False) -> str:
        """Why `ep` is not an expert-parallel degree on a dp x tp mesh ("" when it is one)."""
        if not self.expert_ops:
            return "the model has no expert matmuls"
        strategies = self.sharding(tp, microbatch_size, sequence_parallel, folded).strategies
        if folded:
            return ep_blocker(self.expert_ops, strategies, dp * tp, 1, ep).replace(f"dp={dp * tp}",
                                                                                 f"tp x dp={tp} x {dp}")
        return ep_blocker(self.expert_ops, strategies, dp, tp, ep)

    # --- prepared segments under a recomputation mode ----------------------------------------

    def prepared(self, tp: int, microbatch_size: int, recompute: str, cp: int = 1,
                 sequence_parallel: bool = True, folded: bool = False) -> PreparedSegments:
        if is_blocks_mode(recompute):
            raise ValueError(f"recompute {recompute!r} follows the model chunks: use prepared_for with a configuration")
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (recompute, cp) + (("folded",) if folded else ())
        if key not in self._prepared:
            self._prepared[key] = PreparedSegments.build(
                self.segment_costs(tp, microbatch_size, cp, sequence_parallel, folded), recompute)
        return self._prepared[key]

    def prepared_for(self, config: ParallelConfig, recompute: str | None = None) -> PreparedSegments:
        """The prepared segments of a configuration (under another recomputation mode if given);
        under precision "fp8" with its float8 linears' matmuls in their compute (fp8_segments.py)."""
        mode = recompute or config.recompute
        if is_blocks_mode(mode):
            return self._blocks(config, mode)
        prepared = self.prepared(config.tp, config.microbatch_size, mode, config.cp, config.sequence_parallel,
                                 config.folds_experts)
        if self.fp8 is None:
            return prepared
        key = self.tp_key(config.tp, config.microbatch_size, config.sequence_parallel) + (
            mode, config.cp, config.folds_experts, self.fp8.gathers_in_float8(config))
        if key not in self._float8_prepared:
            self._float8_prepared[key] = float8_segments(
                self.fp8, self.graph, prepared, replace(config, recompute=mode),
                lambda priced: self.strategies(priced.tp, priced.microbatch_size, priced.sequence_parallel,
                                               priced.folds_experts))
        return self._float8_prepared[key]

    def _blocks(self, config: ParallelConfig, mode: str) -> PreparedSegments:
        """"blocks:<N>": each segment's row from "full" where the mode recomputes it, from "none"
        elsewhere (solver/recompute_blocks.py), for the configuration's model chunks."""
        num_chunks = config.num_chunks
        key = self.tp_key(config.tp, config.microbatch_size, config.sequence_parallel) + (
            mode, config.cp, config.folds_experts, num_chunks, config.pipeline_split,
            self.fp8.gathers_in_float8(config) if self.fp8 is not None else None)
        if key not in self._blocks_prepared:
            blocks, split = self.step_model.segment_blocks, config.pipeline_split
            flags = recomputed_flags(blocks, num_chunks=num_chunks, split=split, mode=mode)
            self._blocks_prepared[key] = PreparedSegments.mixed(
                self.prepared_for(config, "none"), self.prepared_for(config, "full"), flags, mode,
                workspace=not holds_others(blocks, num_chunks=num_chunks, split=split, mode=mode))
        return self._blocks_prepared[key]

    def least_work(self, config: ParallelConfig) -> PreparedSegments:
        """What a lower bound on the configuration's time may count: its own mode's segments, or
        under pipelining the lightest mode's (stages that fit may recompute less, `lighter`)."""
        if config.pp == 1:
            return self.prepared_for(config)
        return self.prepared_for(config, RECOMPUTE_MODES[0])

    def lighter(self, config: ParallelConfig) -> dict[str, PreparedSegments]:
        """Cheaper recomputation modes than the configuration's, for stages that can afford them
        ("gathers" only with sequence parallelism: GATHERS_WITHOUT_SP)."""
        if config.pp == 1:
            return {}
        modes = [mode for mode in lighter_modes(config.recompute)
                 if mode != "gathers" or config.sequence_parallel]
        return {mode: self.prepared_for(config, mode) for mode in modes}

    # --- estimates ---------------------------------------------------------------------------

    def evaluate(self, config: ParallelConfig) -> tuple[Estimate, ShardingResult]:
        """A configuration given by hand, priced as given (its recompute mode on every stage);
        checked beforehand (constraints.ConfigChecks)."""
        sharding = self.sharding(config.tp, config.microbatch_size, config.sequence_parallel, config.folds_experts)
        estimate = self.step_model.estimate(self.prepared_for(config), config)
        estimate = self.calibrated(estimate)
        if estimate is None:
            raise ConfigError(f"{config.describe()}: the model has {len(self.graph.segments)} segments, too few "
                              f"for {config.pp * config.virtual_stages} pipeline chunks")
        return estimate, sharding

    def counts(self, tp: int, microbatch_size: int, sequence_parallel: bool = True,
               folded: bool = False) -> dict[str, SegmentCounts]:
        key = self.tp_key(tp, microbatch_size, sequence_parallel) + (("folded",) if folded else ())
        if key not in self._counts:
            sharding = self.sharding(tp, microbatch_size, sequence_parallel, folded)
            self._counts[key] = segment_counts(self.graph, self.segment_costs(
                tp, microbatch_size, sequence_parallel=sequence_parallel, folded=folded), sharding.strategies,
                fused_wgrad=self.cluster.device_kind == "cuda" and self.policy.casts_once_per_step,
                unfused_attention=runs_math_attention(self.cluster.device_kind, tp))
        return self._counts[key]

    def features(self, estimate: Estimate) -> dict[str, float]:
        """Features of the calibrated terms for a priced configuration (overheads.py)."""
        config = estimate.config
        cores = self.overheads.calibration.num_cores if self.overheads else 0
        return step_features(estimate, self.counts(config.tp, config.microbatch_size, config.sequence_parallel,
                                                   config.folds_experts),
                             self.step_model, processes_per_node=self.cluster.devices_per_node,
                             num_cores=cores or _cpu_cores(self.cluster))

    def calibrated(self, estimate: Estimate | None) -> Estimate | None:
        if estimate is not None and self.fp8 is not None:
            estimate = self.fp8.apply(estimate, lambda config: self.strategies(config.tp, config.microbatch_size,
                                                                               config.sequence_parallel,
                                                                               config.folds_experts))
        if estimate is None or self.overheads is None:
            return estimate
        return self.overheads.apply(estimate, self.features(estimate))


def lower_bound_s(prepared: PreparedSegments, config: ParallelConfig) -> float:
    """No pipeline rank is faster than an even share of the work, nor than the slowest chunk of
    the most balanced cut: t_max >= max(total / p, slowest chunk). 1F1B and GPipe take
    (m - 1) t_max + the sum of the stages (>= total), interleaved (m + (p - 1) / v) t_max, the
    zero-bubble schedules at least m t_max."""
    saving = prepared.ep_saving_bound_s if config.ep > 1 else 0.0  # ep's bigger expert matmuls
    saving += prepared.fused_wgrad_saving_bound_s  # weight gradients fused into their GEMMs, where they are
    total = prepared.work_s - saving
    m, p = config.num_microbatches, config.pp
    slowest = max(total / p, prepared.slowest_chunk_s(config.num_chunks) - saving) if p > 1 else total
    if config.schedule == "interleaved" and p > 1:
        return (m + (p - 1) / config.virtual_stages) * slowest
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        return m * slowest
    return (m - 1) * slowest + total


def _cpu_cores(cluster: Cluster) -> int:
    """Cores of this machine for a CPU cluster (its processes share them), else 0 (GPUs)."""
    import os

    return (os.cpu_count() or 1) if cluster.device_kind == "cpu" else 0

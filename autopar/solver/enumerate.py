"""What the search enumerates: meshes (every factorisation of the devices into pp x dp x cp x tp,
tensor parallel inside a node unless constrained otherwise, context parallelism only where the
sequence can be split), microbatch sizes (powers of two dividing the per-replica batch), and for
one mesh and microbatch size its configurations: schedules and their virtual stages, recompute
modes that price differently, ZeRO stages, expert-parallel degrees and optimizer offload.

A constraint fixes an axis to its value (or refuses it with the reason); each axis is one method
of Candidates, and `configs` nests them. A new axis is one more method and one more loop there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.errors import ConfigError
from autopar.graph import OpGraph
from autopar.solver.configs import ZERO_BUBBLE_SCHEDULES, ParallelConfig, chunks_per_device
from autopar.solver.constraints import ConfigChecks, Constraints, schedule_accepts
from autopar.solver.expert_folding import runtime_blocker
from autopar.solver.pipeline import BALANCED, block_flags, split_blocker
from autopar.solver.pricing import Pricing
from autopar.solver.recompute import RECOMPUTE_MODES
from autopar.solver.recompute_blocks import blocks_blocker, is_blocks_mode
from autopar.solver.recompute_modules import classify, is_modules_mode, mode_kinds
from cost_model.memory import PrecisionPolicy

MeshDegrees = tuple[int, int, int, int]
"""(tp, pp, dp, cp)."""


@dataclass(frozen=True, kw_only=True)
class Candidates:
    """The meshes and configurations one planner's search may price."""

    graph: OpGraph
    """The captured model (its segments and repeated blocks, its batch)."""
    cluster: Cluster
    """The devices to factorise."""
    global_batch: int
    """Samples per step."""
    policy: PrecisionPolicy
    """Precision policy (whether ZeRO-2 reduces less than ZeRO-1 under pipelining)."""
    pricing: Pricing
    """Prepared segments (which recompute modes differ) and expert-parallel degrees."""
    checks: ConfigChecks
    """Checks of fixed cp and ep degrees, raised where a constraint cannot hold."""
    max_microbatch_size: int
    """Largest microbatch size searched (SearchOptions.max_microbatch_size)."""
    min_tokens_per_cp_rank: int
    """Tokens of a sequence each cp rank keeps at least (SearchOptions.min_tokens_per_cp_rank)."""

    @property
    def num_blocks(self) -> int:
        return sum(1 for segment in self.graph.segments if segment.block_group is not None)

    # --- meshes and microbatches -------------------------------------------------------------

    def meshes(self, constraints: Constraints) -> list[MeshDegrees]:
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
                for cp in self.cps(rest // pp, constraints):
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

    def cps(self, rest: int, constraints: Constraints) -> list[int]:
        """Context-parallel degrees dividing `rest` devices (see SearchOptions.min_tokens_per_cp_rank)."""
        if constraints.cp:
            self.checks.check_cp(constraints.cp)
            return [constraints.cp] if rest % constraints.cp == 0 else []
        if self.checks.cp_blocker:
            return [1]
        sequence_length = self.checks.sequence_length
        most = sequence_length // max(1, self.min_tokens_per_cp_rank)
        return [1] + [c for c in _divisors(rest) if 1 < c <= most and sequence_length % (2 * c) == 0]

    def microbatches(self, dp: int, constraints: Constraints) -> list[int]:
        local = self.global_batch // dp
        if constraints.microbatch_size:
            if local % constraints.microbatch_size:
                raise ConfigError(f"microbatch size {constraints.microbatch_size} does not divide the per-replica "
                                  f"batch {local} (global batch {self.global_batch} / dp {dp})")
            return [constraints.microbatch_size]
        if not self.graph.batch_dynamic:
            return [self.graph.batch_size] if local % self.graph.batch_size == 0 else []
        # Powers of two: what practitioners use, and half the intra-op solves of all divisors.
        return [b for b in _divisors(local) if b <= self.max_microbatch_size and b & (b - 1) == 0]

    # --- the configurations of one mesh and microbatch size ----------------------------------

    def configs(self, tp: int, pp: int, dp: int, microbatch: int, constraints: Constraints, cp: int = 1, *,
                offload: bool = False) -> Iterator[ParallelConfig]:
        m = self.global_batch // (dp * microbatch)
        schedules = self.schedules(pp, constraints)
        sequence_parallel = constraints.sequence_parallel_allowed
        modes = self.recompute_modes(tp, microbatch, constraints, cp, sequence_parallel)
        zeros = self.zero_stages(pp, dp, constraints, cp, offload=offload)
        eps = self.ep_degrees(tp, pp, dp, microbatch, constraints, cp, offload=offload) \
            if tp == 1 or constraints.etp != 1 else []
        folded = self.folded_ep_degrees(tp, pp, dp, microbatch, constraints, cp, offload=offload)
        split = constraints.pipeline_split or BALANCED
        for schedule, virtual in schedules:
            if not schedule_accepts(schedule, pp, m, virtual) or self.split_blocker(pp, schedule, virtual, split):
                continue
            for recompute in modes:
                if is_blocks_mode(recompute) and blocks_blocker(
                        self.pricing.step_model.segment_blocks, num_chunks=pp * chunks_per_device(schedule, virtual),
                        split=split, mode=recompute):
                    continue  # a chunk holds fewer blocks than the mode recomputes
                runs_folded = not runtime_blocker(cp, recompute)
                for ep, etp in [(ep, None) for ep in eps] + [(ep, 1) for ep in folded if runs_folded]:
                    for zero in zeros:
                        if zero == 3 and schedule in ZERO_BUBBLE_SCHEDULES:
                            continue  # ZERO3_WITH_ZERO_BUBBLE
                        yield ParallelConfig(dp=dp, tp=tp, pp=pp, microbatch_size=microbatch, num_microbatches=m,
                                             schedule=schedule, virtual_stages=virtual, recompute=recompute,
                                             zero_stage=zero, ep=ep, cp=cp, offload=offload,
                                             sequence_parallel=sequence_parallel, etp=etp, pipeline_split=split)

    def recompute_modes(self, tp: int, microbatch: int, constraints: Constraints, cp: int = 1,
                        sequence_parallel: bool = True) -> list[str]:
        if constraints.recompute:
            if is_modules_mode(constraints.recompute):
                classify(self.graph).check(mode_kinds(constraints.recompute))
            return [constraints.recompute]
        return self.distinct_modes(tp, microbatch, cp, sequence_parallel)

    def distinct_modes(self, tp: int, microbatch: int, cp: int = 1, sequence_parallel: bool = True) -> list[str]:
        """Recomputation modes that price differently from every lighter one (without tensor
        parallelism "gathers" is "none": nothing is gathered). Without sequence parallelism
        "gathers" is not a mode at all (GATHERS_WITHOUT_SP). The module sets the model holds
        (recompute_modules.CANDIDATE_KINDS) come after "gathers"."""
        distinct: list[str] = []
        modes = list(RECOMPUTE_MODES)
        modes[modes.index("selective"):modes.index("selective")] = classify(self.graph).candidate_modes()
        for mode in modes:
            if mode == "gathers" and not sequence_parallel:
                continue
            prepared = self.pricing.prepared(tp, microbatch, mode, cp, sequence_parallel)
            if not any(prepared.same_as(self.pricing.prepared(tp, microbatch, kept, cp, sequence_parallel))
                       for kept in distinct):
                distinct.append(mode)
        return distinct

    def zero_stages(self, pp: int, dp: int, constraints: Constraints, cp: int = 1, *,
                    offload: bool = False) -> list[int]:
        zeros = [constraints.zero_stage] if constraints.zero_stage is not None else \
            ([0] if dp * cp == 1 else [0, 1, 2, 3])
        if constraints.zero_stage is None and pp > 1 and self.policy.dp_reduce_bytes >= self.policy.grad_bytes:
            # Under pipelining ZeRO-2 reduces gradients once, in the last microbatch, as ZeRO-1
            # does, and accumulates them unsharded until then: ZeRO-1's time, no less memory.
            zeros = [zero for zero in zeros if zero != 2]
        if offload:
            zeros = [zero for zero in zeros if zero == 3] if constraints.zero_stage is not None else [3]
        return zeros

    def ep_degrees(self, tp: int, pp: int, dp: int, microbatch: int, constraints: Constraints, cp: int = 1, *,
                   offload: bool = False) -> list[int]:
        """Expert-parallel degrees (1: none); ep > 1 with every ZeRO stage, not with offload."""
        sequence_parallel = constraints.sequence_parallel_allowed
        if constraints.ep and constraints.ep > 1:
            if not self.checks.expert_ops:  # wrong for every mesh: say why now
                m = self.global_batch // (dp * microbatch)
                self.checks.check_ep(ParallelConfig(dp=constraints.ep, tp=tp, pp=pp, microbatch_size=microbatch,
                                                    num_microbatches=m, zero_stage=constraints.zero_stage or 0,
                                                    ep=constraints.ep, sequence_parallel=sequence_parallel))
            eps = [constraints.ep] if constraints.ep in self.pricing.ep_options(
                tp, dp, microbatch, sequence_parallel) else []
        elif constraints.ep == 1:
            eps = [1]
        else:
            eps = [1] + self.pricing.ep_options(tp, dp, microbatch, sequence_parallel)
        if offload:  # offload runs without ep: none where ep > 1 is asked for
            eps = [] if constraints.ep and constraints.ep > 1 else [1]
        return eps

    def folded_ep_degrees(self, tp: int, pp: int, dp: int, microbatch: int, constraints: Constraints, cp: int = 1,
                          *, offload: bool = False) -> list[int]:
        """Expert-parallel degrees of MoE parallel folding (etp = 1 with tp > 1: the ep group over
        tp x dp, solver/expert_folding.py), searched beside etp = tp where autopar's runtime runs it."""
        sequence_parallel = constraints.sequence_parallel_allowed
        if tp == 1 or offload or constraints.etp not in (None, 1) or constraints.ep == 1 or not self.checks.expert_ops \
                or runtime_blocker(cp, "none") or self.pricing.folding_blocker(tp, sequence_parallel, cp):
            return []
        try:
            options = self.pricing.ep_options(tp, dp, microbatch, sequence_parallel, True)
        except ConfigError:  # the MoE layers cannot be token-local on this model's tp plan
            return []
        if constraints.ep:
            return [constraints.ep] if constraints.ep in options else []
        return options

    # --- schedules and virtual stages --------------------------------------------------------

    def schedules(self, pp: int, constraints: Constraints) -> list[tuple[str, int]]:
        virtual = self.virtual_stages(pp, constraints)
        interleavings = virtual or self.interleavings(pp)
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

    def split_blocker(self, pp: int, schedule: str, virtual: int, split: str) -> str:
        """Why the pipeline split cannot cut this model into the schedule's chunks ("" when it can)."""
        if split == BALANCED or pp == 1:
            return ""
        chunks = pp * chunks_per_device(schedule, virtual)
        return split_blocker(block_flags(self.graph.segments), chunks, split)

    def interleavings(self, pp: int) -> list[int]:
        """Chunks per device with at least two layers per chunk on average (uneven chunks allowed)."""
        return [v for v in (2, 3, 4) if pp and self.num_blocks >= 2 * pp * v]

    # --- when nothing is left ----------------------------------------------------------------

    def _ep_reasons(self, constraints: Constraints) -> list[str]:
        """Why the fixed ep is no expert-parallel degree, on the meshes the constraints allow."""
        reasons = [f"ep={constraints.ep} does not run with optimizer offload"] if constraints.offload else []
        for tp, _, dp, _ in self.meshes(constraints):
            microbatch = constraints.microbatch_size or next(iter(self.microbatches(dp, constraints)), 1)
            blocker = self.pricing.ep_blocker(tp, dp, microbatch, constraints.ep,
                                              constraints.sequence_parallel_allowed)
            if blocker:
                reasons.append(blocker)
        return reasons or [f"ep={constraints.ep} must divide dp and the experts of every expert layer per "
                           "tensor-parallel rank"]

    def no_config_message(self, constraints: Constraints) -> str:
        """Why no configuration was left to price, in the terms of the constraints given."""
        fixed = ", ".join(f"{name}={value}" for name, value in vars(constraints).items() if value is not None)
        reasons: list[str] = []
        for tp, pp, dp, _ in self.meshes(constraints):
            most = self.global_batch // dp
            if pp > 1 and constraints.schedule != "gpipe" and most < pp:
                reasons.append(f"pp={pp} with dp={dp} leaves at most {most} microbatches of the global batch "
                               f"{self.global_batch}, fewer than the {pp} stages a 1F1B pipeline must fill "
                               "(use a larger batch, a smaller pp, or --schedule gpipe)")
            fixed_batch = self.graph.batch_size
            if not self.graph.batch_dynamic and most % fixed_batch and not constraints.microbatch_size:
                reasons.append(f"the model was captured with a fixed batch of {fixed_batch} (torch.export could "
                               f"not keep its batch dimension dynamic), so every microbatch is {fixed_batch} "
                               f"sequences, and dp={dp} leaves each replica {most} of the global batch "
                               f"{self.global_batch}, not a multiple of it (give example inputs whose batch is "
                               "the microbatch size you want, e.g. 1, or a global batch that dp x "
                               f"{fixed_batch} divides)")
            if (not self.graph.batch_dynamic and pp > 1 and constraints.schedule != "gpipe" and most >= pp
                    and most // fixed_batch < pp):
                reasons.append(f"the model was captured with a fixed batch of {fixed_batch} (torch.export could "
                               f"not keep its batch dimension dynamic), so every microbatch is {fixed_batch} "
                               f"sequences and pp={pp} with dp={dp} gets {most // fixed_batch} microbatch(es) of "
                               f"the global batch {self.global_batch}, fewer than the {pp} stages a 1F1B pipeline "
                               "must fill (give example inputs whose batch is the microbatch size you want, e.g. "
                               "1, a larger global batch, or --schedule gpipe)")
            if constraints.schedule == "interleaved" and not (self.virtual_stages(pp, constraints)
                                                              or self.interleavings(pp)):
                reasons.append(f"the interleaved schedule needs at least 2 chunks of layers per stage, and the "
                               f"{self.num_blocks} layers do not split into pp={pp} x 2, 3 or 4 chunks")
            if constraints.schedule == "zbv" and 2 * pp > len(self.graph.segments):
                reasons.append(f"the zbv schedule cuts the model into 2 x pp = {2 * pp} chunks, more than its "
                               f"{len(self.graph.segments)} segments")
            if constraints.pipeline_split not in (None, BALANCED):
                blockers = [self.split_blocker(pp, schedule, virtual, constraints.pipeline_split)
                            for schedule, virtual in self.schedules(pp, constraints)]
                reasons += [blocker for blocker in blockers[:1] if blocker and all(blockers)]
            if is_blocks_mode(constraints.recompute or ""):
                blockers = [blocks_blocker(self.pricing.step_model.segment_blocks, mode=constraints.recompute,
                                           num_chunks=pp * chunks_per_device(schedule, virtual),
                                           split=constraints.pipeline_split or BALANCED)
                            for schedule, virtual in self.schedules(pp, constraints)]
                reasons += [blocker for blocker in blockers[:1] if blocker and all(blockers)]
        if constraints.etp == 1 and constraints.tp != 1:
            blocker = runtime_blocker(constraints.cp or 1, constraints.recompute or "none")
            if not self.checks.expert_ops:
                blocker = ("with tp > 1 it folds the MoE layers (experts unsplit by tp), and the model has no expert "
                           "matmuls; leave etp out")
            reasons += [f"etp=1: {blocker}"] if blocker else []
        if constraints.ep and constraints.ep > 1:
            reasons += self._ep_reasons(constraints)
        unique = list(dict.fromkeys(reasons))[:2]
        return (f"no configuration satisfies {fixed or 'the search'}: "
                f"{'; '.join(unique) or 'every candidate was ruled out'}; relax a constraint")


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]

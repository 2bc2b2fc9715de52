"""What a user may fix of a configuration (Constraints) and the checks of fixed values: types and
ranges of the constraints and of `evaluate`'s arguments, degrees against the cluster and the batch,
the pipeline against the model's segments, and the pairs that cannot run together (ZeRO-3 with a
zero-bubble schedule, recompute 'gathers' without sequence parallelism). Each check runs before
the search (most before the capture) and says what to change.

ConfigChecks holds the checks that need the captured model (the Planner's): a whole configuration
against the cluster, the batch and the model (its schedule's microbatches, schedule_accepts; its
context-parallel degree against the sequence; its expert-parallel degree against the expert ops;
optimizer offload against the device), each with the message that says what to change."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import ConfigError
from autopar.graph import OpGraph
from autopar.solver.expert_folding import etp_blocker
from autopar.solver.experts import ExpertOp
from autopar.solver.pipeline import BALANCED, block_flags, check_pipeline_split, split_spans
from autopar.solver.recompute_blocks import blocks_blocker, is_blocks_mode
from autopar.solver.recompute_modules import check_recompute, classify, is_modules_mode, mode_kinds, modules_mode
from autopar.solver.step_model import SCHEDULES, ZERO_BUBBLE_SCHEDULES, ParallelConfig, StepModel
from autopar.validation import MAX_DEVICES, MAX_GLOBAL_BATCH, check_choice, check_int, shorten, type_name


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Fixes any part of the configuration; None leaves it to the search."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    """Context parallelism: ranks each sequence is split over (1: none)."""
    microbatch_size: int | None = None
    schedule: str | None = None
    """"1f1b", "gpipe", "interleaved", "zb1p" or "zbv"."""
    virtual_stages: int | None = None
    """Model chunks per device (interleaved, zb1p; zbv always has 2)."""
    layers_per_virtual_stage: int | None = None
    """Alternative to virtual_stages, as Megatron-LM's --num-layers-per-virtual-pipeline-stage."""
    recompute: str | None = None
    """One of RECOMPUTE_MODES, or "modules:<kinds>" (solver/recompute_modules.py; the constraint
    `recompute_modules` = "layernorm,moe_act" is a way to write it)."""
    zero_stage: int | None = None
    ep: int | None = None
    """Expert-parallel degree (divides dp; 1: experts not split over data-parallel ranks)."""
    etp: int | None = None
    """Expert tensor-parallel degree: tp (or None, the search's only choice today) or 1 with
    tp > 1 and ep > 1 (MoE parallel folding, solver/expert_folding.py: priced by `evaluate`,
    refused by `plan` until the runtime runs it)."""
    offload: bool | None = None
    """Optimizer offload: True forces it, False forbids it, None uses it only when nothing fits
    without it."""
    sequence_parallel: bool | None = None
    """False: tensor parallelism without sequence parallelism (norms, dropouts and residual adds
    replicated on the tp ranks, partial outputs all-reduced), as Megatron-LM runs without
    --sequence-parallel. True or None: the intra-op solve may shard activations by sequence where
    that is cheaper (less compute and activation memory on norms, dropouts and residuals, against a
    reduce-scatter and an all-gather in place of each all-reduce: small messages favour the
    all-reduce). Unlike other constraints this one is not searched as two options: the allowed
    placements include every one the restricted solve could choose."""
    pipeline_split: str | None = None
    """How pipeline chunks are cut (solver/pipeline.py): None or "balanced", autopar's cut (the
    slowest stage as fast as memory allows); "uniform" (equal repeated blocks per chunk, embedding
    on the first, head and loss on the last, as Megatron-LM), "uniform:embedding", "uniform:head",
    "uniform:embedding,head" (those counted as a block), or "first=N,last=M". The search tries only
    the pipelines the split divides."""

    @property
    def sequence_parallel_allowed(self) -> bool:
        return self.sequence_parallel is not False

    @classmethod
    def from_value(cls, value: "Constraints | dict | None") -> "Constraints":
        if value is None:
            return cls()
        if isinstance(value, Constraints):
            return value
        if isinstance(value, dict) and value.get("recompute_modules") is not None:
            value = _with_modules_mode(value)
        value = {key: item for key, item in value.items() if key != "recompute_modules"}
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown constraint(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**value)


GATHERS_WITHOUT_SP = ("recompute 'gathers' keeps sequence-parallel norm outputs sharded and gathers them again in "
                      "backward; without sequence parallelism nothing is gathered: use recompute 'none' (or "
                      "'selective', which recomputes attention), or allow sequence parallelism")

ZERO3_WITH_ZERO_BUBBLE = (
    "ZeRO-3 reshards each FSDP unit after its forward, and torch's zero-bubble schedules run a unit's "
    "weight-gradient pass after its input-gradient pass, when FSDP has already resharded the unit and "
    "reduced its gradients: the gradients come out wrong (measured on gloo against one process). Use "
    "ZeRO-1 or -2 with zb1p/zbv (under pipelining they keep the parameters gathered for the step), or "
    "ZeRO-3 with 1f1b, interleaved or gpipe")


_DEGREES = ("dp", "tp", "pp")
_POSITIVE_CONSTRAINTS = ("dp", "tp", "pp", "cp", "microbatch_size", "virtual_stages", "layers_per_virtual_stage",
                         "ep", "etp")


def check_constraint_values(value: Any) -> dict[str, Any]:
    """The constraints as a dict of checked values (None: left to the search)."""
    if value is None:
        return {}
    if isinstance(value, Constraints):
        value = {name: getattr(value, name) for name in value.__dataclass_fields__}
    if not isinstance(value, dict):
        raise ConfigError(f"constraints must be a dict such as {{'tp': 8, 'pp': 2}} (or a Constraints), "
                          f"got {type_name(value)} {shorten(value)}")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"constraint names are strings such as 'tp', got {shorten(key)}")
        if item is None:
            checked.setdefault(key, None)
        elif key in _POSITIVE_CONSTRAINTS:
            checked[key] = check_int(item, f"constraints['{key}']", maximum=MAX_DEVICES)
        elif key == "zero_stage":
            checked[key] = check_choice(item, "constraints['zero_stage']", (0, 1, 2, 3))
        elif key == "schedule":
            checked[key] = check_choice(item, "constraints['schedule']", SCHEDULES)
        elif key == "recompute":
            checked[key] = check_recompute(item, "constraints['recompute']")
        elif key == "recompute_modules":
            checked["recompute"] = _with_modules_mode(value)["recompute"]
        elif key in ("offload", "sequence_parallel"):
            checked[key] = _check_flag(item, f"constraints['{key}']")
        elif key == "pipeline_split":
            checked[key] = check_pipeline_split(item, "constraints['pipeline_split']")
        else:
            checked[key] = item  # an unknown name: Constraints.from_value names the known ones
    if checked.get("sequence_parallel") is False and checked.get("recompute") == "gathers":
        _refuse_gathers_without_sp("constraints['recompute']")
    _refusezero3_with_zero_bubble(checked.get("schedule"), checked.get("zero_stage"), "constraints")
    return checked


def _with_modules_mode(value: dict) -> dict:
    """Constraints where `recompute_modules` ("layernorm,moe_act") is written as recompute "modules:<kinds>"."""
    if value.get("recompute") is not None:
        raise ConfigError("constraints 'recompute' and 'recompute_modules' both name a recomputation mode: give one "
                          "('recompute_modules': 'layernorm,moe_act' is recompute 'modules:layernorm,moe_act')")
    checked = {key: item for key, item in value.items() if key != "recompute_modules"}
    checked["recompute"] = modules_mode(value["recompute_modules"], "constraints['recompute_modules']")
    return checked


def zero3_with_zero_bubble(schedule: Any, zero_stage: Any) -> str:
    """Why this schedule cannot run with this ZeRO stage ("" when it can)."""
    if schedule in ZERO_BUBBLE_SCHEDULES and zero_stage == 3:
        return f"schedule '{schedule}' with zero_stage 3: {ZERO3_WITH_ZERO_BUBBLE}"
    return ""


def _refusezero3_with_zero_bubble(schedule: Any, zero_stage: Any, where: str) -> None:
    reason = zero3_with_zero_bubble(schedule, zero_stage)
    if reason:
        raise ConfigError(f"{where}: {reason}")


def _refuse_gathers_without_sp(name: str) -> None:
    raise ConfigError(f"{name}='gathers' with sequence_parallel=False: {GATHERS_WITHOUT_SP}")


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {type_name(value)} {shorten(value)}")
    return value


def search_etp(constraints: Constraints) -> Constraints:
    """The constraints the search runs for a fixed etp: etp = 1 searches the folded configurations
    (tp > 1, MoE parallel folding, where the runtime runs it) and tp = 1; etp > 1 pins tp = etp
    (the experts on the tp solve); an etp between is refused with the reason."""
    from dataclasses import replace

    if constraints.etp is None or constraints.etp == 1:
        return constraints
    if constraints.tp is not None and constraints.tp != constraints.etp:
        raise ConfigError(f"etp={constraints.etp} with tp={constraints.tp}: the planner runs the experts on the tp "
                          f"ranks (etp = tp) or unsplit by tp (etp = 1); use etp={constraints.tp}, etp=1 or leave "
                          "etp out")
    return replace(constraints, tp=constraints.etp)


def check_fixed_config(*, tp: Any, pp: Any, dp: Any, microbatch_size: Any, schedule: Any, virtual_stages: Any,
                       layers_per_virtual_stage: Any, recompute: Any, zero_stage: Any, ep: Any = 1,
                       cp: Any = 1, offload: Any = False, sequence_parallel: Any = True, etp: Any = None,
                       pipeline_split: Any = "balanced") -> None:
    """The arguments of `evaluate`: types and ranges, before anything is captured."""
    check_pipeline_split(pipeline_split)
    if etp is not None:
        check_int(etp, "etp", maximum=MAX_DEVICES)
        if isinstance(tp, int) and isinstance(ep, int) and etp_blocker(tp, ep, etp):
            raise ConfigError(etp_blocker(tp, ep, etp))
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("microbatch_size", microbatch_size)):
        check_int(value, name, maximum=MAX_DEVICES if name != "microbatch_size" else MAX_GLOBAL_BATCH)
    for name, value in (("dp", dp), ("virtual_stages", virtual_stages),
                        ("layers_per_virtual_stage", layers_per_virtual_stage)):
        if value is not None:
            check_int(value, name, maximum=MAX_DEVICES)
    check_choice(schedule, "schedule", SCHEDULES)
    check_recompute(recompute, "recompute")
    check_choice(zero_stage, "zero_stage", (0, 1, 2, 3))
    _check_flag(offload, "offload")
    if not _check_flag(sequence_parallel, "sequence_parallel") and recompute == "gathers":
        _refuse_gathers_without_sp("recompute")
    _refusezero3_with_zero_bubble(schedule, zero_stage, "evaluate")


def check_degrees(cluster, global_batch: int, *, dp: int | None = None, tp: int | None = None,
                  pp: int | None = None, microbatch_size: int | None = None, schedule: str | None = None,
                  cp: int | None = None) -> None:
    """Fixed parallel degrees that cannot work on this cluster and batch, said in those terms
    (before any capture: none of this needs the model). An unfixed cp counts as 1 here."""
    devices, per_node = cluster.num_devices, cluster.devices_per_node
    fixed = {name: value for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)) if value}
    for name, value in fixed.items():
        if value > devices:
            raise ConfigError(f"{name}={value} is more than the cluster's {devices} devices; use {name} <= {devices}")
    if tp and tp > per_node:
        raise ConfigError(f"tp={tp} is more than the {per_node} GPUs of one node: tensor parallelism runs inside a "
                          f"node; use tp <= {per_node} and spread the rest over pp or dp")
    for name, value in fixed.items():
        if devices % value:
            raise ConfigError(f"{name}={value} does not divide the cluster's {devices} devices")
    if len(fixed) > 1:
        product = math.prod(fixed.values())
        shown = f"{' x '.join(fixed)} = {' x '.join(map(str, fixed.values()))} = {product}"
        if product > devices or devices % product:
            raise ConfigError(f"{shown} {'is more than' if product > devices else 'does not divide'} the cluster's "
                              f"{devices} devices; dp x tp x pp{' x cp' if cp else ''} must equal {devices}")
        if len(set(fixed) & {"dp", "tp", "pp"}) == 3 and product != devices:
            raise ConfigError(f"{shown}, but the cluster has {devices} devices; dp x tp x pp{' x cp' if cp else ''} "
                              f"must equal {devices}")
    if dp and global_batch % dp:
        raise ConfigError(f"global batch {global_batch} is not divisible by dp={dp}; every data-parallel replica "
                          "takes the same number of samples")
    if microbatch_size:
        local = global_batch // dp if dp else global_batch
        if microbatch_size > local or local % microbatch_size:
            where = f"the per-replica batch {local} (global batch {global_batch} / dp {dp})" if dp else \
                f"the global batch {global_batch}"
            raise ConfigError(f"{where} is not divisible by microbatch size {microbatch_size}")
    if schedule == "interleaved" and pp == 1:
        raise ConfigError("the interleaved schedule needs pp >= 2 (it interleaves model chunks across stages); "
                          "use pp >= 2 or another schedule")
    if schedule in ("zb1p", "zbv") and pp == 1:
        raise ConfigError(f"the {schedule} schedule needs pp >= 2 (it is a pipeline schedule); use pp >= 2 or "
                          "another schedule")


def check_pipeline_depth(graph, pp: int | None) -> None:
    """A pipeline needs at least one segment (prologue, block or epilogue) per stage."""
    segments = len(graph.segments)
    if pp and pp > segments:
        blocks = sum(1 for segment in graph.segments if segment.block_group is not None)
        name = shorten(graph.model_name, 60) if graph.model_name else "the model"
        raise ConfigError(f"pp={pp} needs at least {pp} pipeline segments, but {name} has "
                          f"{segments} ({blocks} repeated blocks and {segments - blocks} other segments); "
                          f"use pp <= {segments}")


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


EpOptions = Callable[..., list[int]]
"""(tp, dp, microbatch size, sequence parallel[, folded]) -> the ep degrees allowed."""
"""(tp, dp, microbatch size, sequence parallel) -> the expert-parallel degrees > 1 the model allows."""


@dataclass(frozen=True, kw_only=True)
class ConfigChecks:
    """Checks of a configuration against one captured model, cluster and global batch."""

    graph: OpGraph
    """The captured model (its segments, its batch)."""
    cluster: Cluster
    """The cluster the configuration must fill."""
    global_batch: int
    """Samples per step: dp x microbatch size x microbatches."""
    step_model: StepModel
    """Says whether the device can offload the optimizer (host link and memory bandwidth)."""
    expert_ops: tuple[ExpertOp, ...]
    """The expert matmuls expert parallelism can split (solver/experts.py)."""
    ep_options: EpOptions
    """The expert-parallel degrees the intra-op solve of a mesh allows (pricing.Pricing.ep_options)."""
    folding_blocker: Callable[[int, bool, int], str]
    """Why the MoE layers cannot be folded at (tp, sequence parallel, cp) (pricing.Pricing.folding_blocker)."""
    sequence_length: int
    """Tokens of the model's sequence (0 when it has none)."""
    cp_blocker: str
    """Why the sequence cannot be split over cp ranks ("" when it can)."""

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
        self._check_choices(config)
        if is_modules_mode(config.recompute):
            classify(self.graph).check(mode_kinds(config.recompute))
        if not schedule_accepts(config.schedule, config.pp, config.num_microbatches, config.virtual_stages):
            raise ConfigError(f"{config.num_microbatches} microbatches cannot fill a {config.schedule} pipeline of "
                              f"{config.pp} stages: 1F1B and the zero-bubble schedules need at least as many "
                              "microbatches as stages, the interleaved schedule a multiple of them; use a smaller "
                              "microbatch or a larger batch")
        self.check_split(config)
        if is_blocks_mode(config.recompute):
            blocker = blocks_blocker(block_flags(self.graph.segments), num_chunks=config.num_chunks,
                                     split=config.pipeline_split, mode=config.recompute)
            if blocker:
                raise ConfigError(blocker)
        self.check_ep(config)
        self.check_offload(config)
        if not self.graph.batch_dynamic and config.microbatch_size != self.graph.batch_size:
            raise ConfigError(f"the model was captured with a fixed batch of {self.graph.batch_size}; "
                              f"microbatch size {config.microbatch_size} cannot be priced")

    @staticmethod
    def _check_choices(config: ParallelConfig) -> None:
        """The schedule, recomputation mode and ZeRO stage, and the pairs that cannot run together."""
        if config.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule '{config.schedule}'; use one of {', '.join(SCHEDULES)}")
        check_recompute(config.recompute, "recompute")
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

    def check_split(self, config: ParallelConfig) -> None:
        """A pipeline split by count that cuts this model's blocks into the configuration's chunks."""
        split = check_pipeline_split(config.pipeline_split)
        if split != config.pipeline_split:
            raise ConfigError(f"pipeline_split {config.pipeline_split!r} is spelt {split!r}: give that")
        chunks = config.num_chunks
        if split != BALANCED and chunks > 1:
            split_spans(block_flags(self.graph.segments), chunks, split)

    def check_ep(self, config: ParallelConfig) -> None:
        if etp_blocker(config.tp, config.ep, config.etp):
            raise ConfigError(etp_blocker(config.tp, config.ep, config.etp))
        if config.folds_experts:
            self.check_folded(config)
            return
        if config.ep == 1:
            return
        if config.ep < 1 or config.dp % config.ep:
            raise ConfigError(f"ep={config.ep} must divide dp={config.dp}: expert parallelism splits the experts over "
                              "groups of ep data-parallel ranks")
        if config.offload:
            raise ConfigError(f"ep={config.ep} with optimizer offload: offload runs without expert parallelism; "
                              "use ep=1 or drop the offload")
        if not self.expert_ops:
            raise ConfigError(f"ep={config.ep}: the model has no expert matmuls that expert parallelism can split "
                              "(an einsum, bmm or grouped matmul over a 3-D expert weight read only by such ops); use ep=1")
        if config.ep not in self.ep_options(config.tp, config.dp, config.microbatch_size, config.sequence_parallel):
            counts = sorted({op.num_experts for op in self.expert_ops})
            raise ConfigError(f"ep={config.ep} with tp={config.tp}: the experts ({counts} per layer, split over tp where "
                              f"the plan shards them) do not split evenly into {config.ep} groups, or the "
                              "tensor-parallel plan leaves the expert tokens partial; use another ep or tp")

    def check_folded(self, config: ParallelConfig) -> None:
        """etp = 1 with tp > 1 (solver/expert_folding.py): ep divides tp x dp and the experts."""
        shown = f"etp=1 with tp={config.tp} ep={config.ep}"
        if config.offload:
            raise ConfigError(f"{shown} with optimizer offload: offload runs without expert parallelism; drop it")
        if not self.expert_ops:
            raise ConfigError(f"{shown}: the model has no expert matmuls to split; use ep=1")
        blocker = self.folding_blocker(config.tp, config.sequence_parallel, config.cp)
        if blocker:
            raise ConfigError(f"{shown}: MoE parallel folding cannot be priced: {blocker}; use etp=tp")
        if (config.tp * config.dp) % config.ep:
            raise ConfigError(f"{shown}: ep must divide tp x dp = {config.tp} x {config.dp} (the ep group is drawn "
                              "from the tp x dp ranks of a stage, tp innermost); use another ep")
        if config.ep not in self.ep_options(config.tp, config.dp, config.microbatch_size, config.sequence_parallel,
                                            True):
            counts = sorted({op.num_experts for op in self.expert_ops})
            raise ConfigError(f"{shown}: the experts ({counts} per layer) do not split evenly into {config.ep} "
                              "groups; use an ep dividing them")

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

    def check_offload(self, config: ParallelConfig) -> None:
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

    def check_offload_constraints(self, constraints: Constraints) -> None:
        """Constraints that ask for optimizer offload where it cannot run (before a search)."""
        if not constraints.offload:
            return
        if constraints.zero_stage not in (None, 3) or constraints.pp not in (None, 1):
            raise ConfigError(f"optimizer offload runs with ZeRO-3 and no pipeline, but the constraints fix "
                              f"zero_stage={constraints.zero_stage} pp={constraints.pp}: drop them or the offload")
        if not self.step_model.can_offload:
            raise ConfigError(f"optimizer offload needs the host link and host memory bandwidth of the device; "
                              f"{self.cluster.device.name} has none set: set host_link_gbs and "
                              "host_memory_bandwidth_gbs in the cluster file's [device] table")

"""Calibrated whole-step terms: what a step costs beyond its kernels and isolated collectives.

The step model (step_model.py) adds up kernels and collectives as the profile measured them one
at a time. A real step also pays, per configuration (cost_model/calibration.py names each term
and its unit):

    compute.in_step             (c - 1) x W          W: compute + recompute + bubble + optimizer
    framework.eager_ops         c_op x ops           ops executed on the critical path per step
    framework.dtensor_dispatch  c_dt x ops           the same ops, when they run on DTensors (tp > 1)
    comm.pattern                (c - 1) x C          C: the collective time the model predicts
    comm.calls                  c_call x calls       collective calls issued per step
    pp.schedule                 c_pp x actions       forward/backward actions of the pipeline schedule
    dp.hooks                    c_hook x units x m   FSDP units x microbatches
    dp.overlap                  c_ov x hidden        synchronisation the model assumes hidden
    optimizer.per_tensor        c_opt x tensors      parameter tensors the optimizer steps
    cpu.core_sharing            (s - 1) x CPU work   s = processes / cores when processes outnumber
                                                     cores (not fitted: the CPU work terms above)

`step_features` computes the features of one priced configuration (used by the planner to add
the terms, and by the calibration to fit the coefficients); `with_overheads` adds the terms to
an estimate, each as its own breakdown entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.graph import OpGraph
from autopar.mesh import Mesh
from autopar.solver.evaluate import SegmentCost
from autopar.solver.step_model import Estimate, StageEstimate, StepModel
from cost_model.calibration import CPU_WORK_TERMS, TERMS, Calibration, core_sharing_factor, is_multiplier

COMM_BREAKDOWN_PREFIXES = ("tp.", "pp.send_recv", "pp.tied_weights", "dp.gradient_sync")
WORK_BREAKDOWN_KEYS = ("compute", "recompute", "bubble", "optimizer")
_STEP_COLLECTIVES = 2
"""Collectives every step issues besides gradients: the loss averaged over dp, a pipeline's loss broadcast."""


@dataclass(frozen=True, kw_only=True)
class SegmentCounts:
    """What one segment runs per microbatch, counted (not timed)."""

    num_ops: float
    """Ops executed: forward calls plus backward calls of ops that need a gradient."""
    num_collectives: float
    """Tensor-parallel collectives, forward + backward."""
    num_param_tensors: int
    """Trainable parameter tensors it holds (the optimizer steps each)."""


def segment_counts(graph: OpGraph, segments: list[SegmentCost]) -> dict[str, SegmentCounts]:
    """Counts per segment name, from the captured graph and the intra-op solution's events."""
    owner: dict[str, str] = {}
    for segment in graph.segments:
        for name in segment.nodes:
            owner[name] = segment.name
    tensors: dict[str, int] = {}
    for param in graph.params:
        if not param.trainable:
            continue
        users = [owner[user] for user in graph.consumers.get(param.node, ()) if user in owner]
        if users:
            tensors[users[0]] = tensors.get(users[0], 0) + 1
    by_name = graph.by_name
    costs = {cost.name: cost for cost in segments}
    counts = {}
    for segment in graph.segments:
        cost = costs.get(segment.name, SegmentCost(name=segment.name))
        calls = [by_name[name] for name in segment.nodes if by_name[name].kind == "call"]
        ops = len(calls) + sum(1 for node in calls if node.requires_grad)
        counts[cost.name] = SegmentCounts(num_ops=float(ops), num_collectives=float(len(cost.comm)),
                                          num_param_tensors=tensors.get(segment.name, 0))
    return counts


def step_features(estimate: Estimate, counts: dict[str, SegmentCounts], step_model: StepModel) -> dict[str, float]:
    """Feature of each calibrated term (cost_model.calibration.TERMS) for one configuration."""
    config, breakdown = estimate.config, estimate.breakdown_s
    m = config.num_microbatches
    slowest = max(estimate.stages, key=lambda stage: stage.time_per_microbatch_s)
    busy_s = m * slowest.time_per_microbatch_s
    pipeline_factor = 1.0 + breakdown.get("bubble", 0.0) / busy_s if busy_s > 0 else 1.0
    mine = [counts[name] for name in slowest.segment_names if name in counts]
    ops = m * pipeline_factor * sum(c.num_ops * (1.5 if slowest.recompute == "full" else 1.0) for c in mine)
    fsdp = config.zero_stage >= 1 and config.dp > 1
    units = max((_fsdp_units(stage, counts) for stage in estimate.stages), default=0)
    tensors = max((sum(counts[n].num_param_tensors for n in stage.segment_names if n in counts)
                   for stage in estimate.stages), default=0)
    chunks = len(slowest.chunks) or 1
    actions = 2.0 * m * chunks if config.pp > 1 else 0.0
    calls = m * sum(c.num_collectives for c in mine) + _dp_calls(config, units, tensors) + _STEP_COLLECTIVES
    calls += 2.0 * m * chunks if config.pp > 1 else 0.0
    exposed = breakdown.get("dp.gradient_sync", 0.0)
    hidden = max(0.0, max((_raw_dp_sync_s(stage, estimate, step_model) for stage in estimate.stages),
                          default=0.0) - exposed)
    return {
        "compute.in_step": sum(breakdown.get(key, 0.0) for key in WORK_BREAKDOWN_KEYS),
        "framework.eager_ops": ops,
        "framework.dtensor_dispatch": ops if config.tp > 1 else 0.0,
        "comm.pattern": sum(seconds for name, seconds in breakdown.items() if name.startswith(COMM_BREAKDOWN_PREFIXES)),
        "comm.calls": calls,
        "pp.schedule": actions,
        "dp.hooks": float(units * m) if fsdp else 0.0,
        "dp.overlap": hidden,
        "optimizer.per_tensor": float(tensors),
    }


def _fsdp_units(stage: StageEstimate, counts: dict[str, SegmentCounts]) -> int:
    """Segments holding parameters are FSDP units, and each stage's root is one more."""
    return 1 + sum(1 for name in stage.segment_names if name in counts and counts[name].num_param_tensors)


def _dp_calls(config, units: int, tensors: int) -> float:
    """Gradient-synchronisation calls per step: ZeRO 0 all-reduces each gradient; FSDP issues
    per unit an all-gather and a reduce-scatter (ZeRO 3: both per microbatch, the all-gather
    twice)."""
    if config.dp <= 1:
        return 0.0
    m = config.num_microbatches
    if config.zero_stage == 0:
        return float(tensors)
    if config.zero_stage == 1:
        return 2.0 * units
    if config.zero_stage == 2:
        return float(units * (m + 1))
    return 3.0 * units * m


def _raw_dp_sync_s(stage: StageEstimate, estimate: Estimate, step_model: StepModel) -> float:
    """Gradient synchronisation before any overlap (what the step model hides part of)."""
    config = estimate.config
    if config.dp <= 1:
        return 0.0
    mesh = Mesh(axis_names=("pp", "dp", "tp"), shape=(config.pp, config.dp, config.tp),
                devices_per_node=step_model.devices_per_node)
    group = mesh.group(1)
    grad_bytes = stage.param_numel * step_model.policy.grad_bytes
    param_bytes = stage.param_numel * step_model.policy.param_bytes
    time_s = step_model.comm.time_s
    m = config.num_microbatches
    if config.zero_stage <= 1:
        return time_s("all_reduce", grad_bytes, group)
    if config.zero_stage == 2:
        return m * time_s("reduce_scatter", grad_bytes, group) + time_s("all_gather", param_bytes, group)
    return m * (2 * time_s("all_gather", param_bytes, group) + time_s("reduce_scatter", grad_bytes, group))


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """A calibration applied to one cluster."""

    calibration: Calibration
    processes_per_node: int
    """Processes (devices) per node of the cluster being planned."""

    @property
    def sharing(self) -> float:
        return core_sharing_factor(self.processes_per_node, self.calibration.num_cores)

    @property
    def lower_bound_factor(self) -> float:
        """No calibrated step is faster than the uncalibrated one times this (multipliers may be < 1)."""
        return min(1.0, *(self.calibration.coefficient(term) for term in TERMS if is_multiplier(term)))

    def terms_s(self, features: dict[str, float]) -> dict[str, float]:
        """Seconds each term adds to the predicted step (multipliers: beyond the prediction)."""
        terms: dict[str, float] = {}
        cpu_work_s = 0.0
        for term in TERMS:
            coefficient, feature = self.calibration.coefficient(term), features.get(term, 0.0)
            value = coefficient * feature
            if term in CPU_WORK_TERMS:
                cpu_work_s += value
            terms[term] = value - feature if is_multiplier(term) else value
        terms["cpu.core_sharing"] = (self.sharing - 1.0) * cpu_work_s
        return terms

    def apply(self, estimate: Estimate, features: dict[str, float]) -> Estimate:
        return with_overheads(estimate, self.terms_s(features))


def with_overheads(estimate: Estimate, terms_s: dict[str, float]) -> Estimate:
    """The estimate with each term as a breakdown entry and added to the step time."""
    breakdown = dict(estimate.breakdown_s)
    for name, seconds in terms_s.items():
        if seconds:
            breakdown[name] = breakdown.get(name, 0.0) + seconds
    step_s = estimate.step_time_s + sum(terms_s.values())
    return replace(estimate, step_time_s=max(step_s, 1e-12), breakdown_s=breakdown)


def overheads_for(cluster, *, torch_version: str, host: str) -> Overheads | None:
    """The profile's calibration for this cluster's processes per node, or None; raises
    ProfileError when it was made for another machine or torch version."""
    from autopar.errors import ProfileError
    from cost_model.calibration import select_calibration
    from cost_model.errors import CostModelInputError

    profile = cluster.profile
    if profile is None or not profile.calibrations:
        return None
    here = host if profile.device_kind == "cpu" else profile.host  # a CPU cluster is this machine
    try:
        calibration = select_calibration(profile.calibrations, processes_per_node=cluster.devices_per_node,
                                         device_name=profile.device_name, host=here, torch_version=torch_version,
                                         source=cluster.name)
    except CostModelInputError as error:
        raise ProfileError(str(error)) from None
    return Overheads(calibration=calibration, processes_per_node=cluster.devices_per_node)

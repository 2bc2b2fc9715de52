"""Calibrated whole-step terms: what a step costs beyond its kernels and isolated collectives.

The step model (step_model.py) adds up kernels and collectives as the profile measured them one
at a time. A real step also pays, per configuration (cost_model/calibration.py names each term
and its unit):

    compute.in_step             (c - 1) x W          W: compute + recompute + bubble + optimizer
    framework.eager_ops         c_op x ops           ops executed on the critical path per step
    framework.dtensor_dispatch  c_dt x dispatches    aten ops dispatched through DTensor (tp > 1): each
                                                     captured op's own count (OpNode.dispatches: a linear
                                                     about 9, a pointwise op 2) over the ops that run on
                                                     DTensors (dtensor_ops.py; local runs pay eager only)
    comm.pattern                (c - 1) x C          C: the collective time the model predicts
    comm.calls                  c_call x latencies   every collective call of the step at the
                                                     profile's small-message latency
    pp.schedule                 c_pp x actions       forward/backward actions of the pipeline schedule
    dp.hooks                    c_hook x units x m   FSDP units x microbatches
    dp.overlap                  c_ov x hidden        synchronisation the model assumes hidden
    optimizer.per_tensor        c_opt x tensors      parameter tensors the optimizer steps
    cpu.core_sharing            (s - 1) x CPU work   s: how much CPU work stretches when processes
                                                     outnumber cores (derived, not fitted: _sharing)

`step_features` computes the features of one priced configuration (used by the planner to add
the terms, and by the calibration to fit the coefficients); `with_overheads` adds the terms to
an estimate, each as its own breakdown entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.graph import OpGraph, Segment
from autopar.mesh import Mesh
from autopar.strategies import Strategy
from autopar.solver.dtensor_ops import runs_on_dtensors
from autopar.solver.evaluate import SegmentCost
from autopar.solver.step_model import Estimate, StageEstimate, StepModel
from cost_model.calibration import CPU_WORK_TERMS, TERMS, Calibration, core_sharing_factor, is_multiplier

COMM_BREAKDOWN_PREFIXES = ("tp.", "cp.", "pp.send_recv", "pp.tied_weights", "dp.gradient_sync")
WORK_BREAKDOWN_KEYS = ("compute", "recompute", "bubble", "optimizer")
LAYOUT_COPY_PREFIX = "tp.layout_copy"
"""Copies around tp collectives (prepared._event_terms): compute-stream work, not communication."""
_SMALL_MESSAGE_BYTES = 4096.0
"""A message whose time is the collective's latency (the profile's smallest size)."""


@dataclass(frozen=True, kw_only=True)
class SegmentCounts:
    """What one segment runs per microbatch, counted (not timed)."""

    num_ops: float
    """Ops executed: forward calls plus backward calls of ops that need a gradient."""
    collectives: dict[str, float]
    """Tensor-parallel collective calls by kind, forward + backward."""
    num_param_tensors: int
    """Trainable parameter tensors it holds (the optimizer steps each)."""
    num_dispatches: float = 0.0
    """aten ops its calls dispatch on DTensors, forward and backward (OpNode.dispatches)."""
    num_dtensor_dispatches: float = 0.0
    """Of num_dispatches, those dispatched through DTensor when the segment runs without
    recomputation (dtensor_ops.py; with recomputation every op is)."""


def segment_counts(graph: OpGraph, segments: list[SegmentCost], strategies: dict[str, Strategy] | None = None, *,
                   fused_wgrad: bool = False, unfused_attention: bool = False) -> dict[str, SegmentCounts]:
    """Counts per segment name, from the captured graph and the intra-op solution's events and
    strategies (None: every op counted as dispatched through DTensor); `unfused_attention`: the
    runtime runs attention on DTensors through torch's math kernel (on CPU)."""
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
    costs = {cost.name: cost for cost in segments}
    solved = _solved_blocks(graph, strategies)
    counts = {}
    for segment in graph.segments:
        cost = costs.get(segment.name, SegmentCost(name=segment.name))
        calls = _calls(graph, segment)
        ops = _executed(calls)
        collectives: dict[str, float] = {}
        for event in cost.comm:
            collectives[event.op] = collectives.get(event.op, 0.0) + 1.0
        counts[segment.name] = SegmentCounts(num_ops=ops, collectives=collectives,
                                             num_param_tensors=tensors.get(segment.name, 0),
                                             num_dispatches=_dispatched(calls, unfused_attention),
                                             num_dtensor_dispatches=_dtensor_dispatches(
                                                 graph, segment, calls, strategies, fused_wgrad, solved,
                                                 unfused_attention))
    return counts


def _calls(graph: OpGraph, segment: Segment) -> list:
    return [graph.by_name[name] for name in segment.nodes if graph.by_name[name].kind == "call"]


def _executed(calls: list) -> float:
    """Ops executed: each call forward, and backward where it needs a gradient."""
    return float(len(calls) + sum(1 for node in calls if node.requires_grad))


def _dispatched(calls: list, unfused_attention: bool) -> float:
    """aten ops the calls dispatch on DTensors, forward and backward (a call the probe did not
    count: one forward, one backward where it needs a gradient); attention as the math kernel's
    ops where `unfused_attention`."""
    return float(sum((unfused_attention and node.unfused_dispatches) or node.dispatches or 1 + node.requires_grad
                     for node in calls))


def _solved_blocks(graph: OpGraph, strategies: dict[str, Strategy] | None) -> dict[int, Segment]:
    """Per repeated block group, its last instance the intra-op solve priced (condense.py keeps the
    first two of identical blocks: the second is the steady one)."""
    solved: dict[int, Segment] = {}
    for segment in graph.segments:
        if strategies is not None and segment.block_group is not None and any(
                name in strategies for name in segment.nodes):
            solved[segment.block_group] = segment
    return solved


def _dtensor_dispatches(graph: OpGraph, segment: Segment, calls: list, strategies: dict[str, Strategy] | None,
                        fused_wgrad: bool, solved: dict[int, Segment], unfused_attention: bool) -> float:
    """aten ops that the calls the runtime runs on DTensors dispatch (forward, and backward where
    they need a gradient); a repeated block solved only through its template counts as the
    instance the solve kept (`solved`)."""
    if strategies is not None and calls and segment.block_group in solved \
            and not any(node.name in strategies for node in calls):
        calls = _calls(graph, solved[segment.block_group])
    on_dtensors = [node for node in calls if strategies is None or runs_on_dtensors(
        graph, node, strategies.get(node.name), fused_wgrad=fused_wgrad)]
    return _dispatched(on_dtensors, unfused_attention)


def step_features(estimate: Estimate, counts: dict[str, SegmentCounts], step_model: StepModel,
                  *, processes_per_node: int = 1, num_cores: int = 0) -> dict[str, float]:
    """Feature of each calibrated term (cost_model.calibration.TERMS) for one configuration,
    and "cpu.sharing": the factor by which CPU work stretches when processes share cores."""
    config, breakdown = estimate.config, estimate.breakdown_s
    m = config.num_microbatches
    slowest = max(estimate.stages, key=lambda stage: stage.time_per_microbatch_s)
    busy_s = m * slowest.time_per_microbatch_s
    pipeline_factor = 1.0 + breakdown.get("bubble", 0.0) / busy_s if busy_s > 0 else 1.0
    mine = [counts[name] for name in slowest.segment_names if name in counts]
    recomputes = 1.5 if slowest.recompute == "full" else 1.0
    ops = m * pipeline_factor * sum(c.num_ops * recomputes for c in mine)
    local_runs = slowest.recompute == "none"  # codegen runs local ops only without recomputation
    # Under tensor parallelism every parameter is a DTensor (codegen), so each microbatch's
    # accumulation into its gradient is one more op DTensor dispatches.
    accumulations = m * sum(c.num_param_tensors for c in mine)
    dtensor_dispatches = accumulations + m * pipeline_factor * sum(
        (c.num_dtensor_dispatches if local_runs else c.num_dispatches) * recomputes for c in mine)
    fsdp = config.zero_stage >= 1 and config.dp > 1
    units = max((_fsdp_units(stage, counts) for stage in estimate.stages), default=0)
    tensors = max((sum(counts[n].num_param_tensors for n in stage.segment_names if n in counts)
                   for stage in estimate.stages), default=0)
    chunks = len(slowest.chunks) or 1
    passes = 3.0 if config.schedule in ("zb1p", "zbv") else 2.0  # zero-bubble: F, B and W actions
    actions = passes * m * chunks if config.pp > 1 else 0.0
    exposed = breakdown.get("dp.gradient_sync", 0.0)
    hidden = max(0.0, max((_raw_dp_sync_s(stage, estimate, step_model) for stage in estimate.stages),
                          default=0.0) - exposed)
    copies_s = sum(seconds for name, seconds in breakdown.items() if name.startswith(LAYOUT_COPY_PREFIX))
    work_s = sum(breakdown.get(key, 0.0) for key in WORK_BREAKDOWN_KEYS) + copies_s
    return {
        "compute.in_step": work_s,
        "framework.eager_ops": ops,
        "framework.dtensor_dispatch": dtensor_dispatches if config.tp > 1 else 0.0,
        "comm.pattern": sum(seconds for name, seconds in breakdown.items()
                            if name.startswith(COMM_BREAKDOWN_PREFIXES)) - copies_s,
        "comm.calls": _call_latencies_s(config, mine, m, units, tensors, actions, step_model),
        "pp.schedule": actions,
        "dp.hooks": float(units * m) if fsdp else 0.0,
        "dp.overlap": hidden,
        "optimizer.per_tensor": float(tensors),
        "cpu.sharing": _sharing(estimate, work_s, processes_per_node, num_cores),
    }


def _sharing(estimate: Estimate, work_s: float, processes_per_node: int, num_cores: int) -> float:
    """How much the step's CPU work stretches when the node's processes outnumber its cores.

    Every rank does about the slowest stage's work (busy = m x its compute + optimizer); the
    node's cores run at most `cores` of them at once, so the step takes at least s x busy with
    s = processes / cores. A pipeline's bubble is idle time other ranks can use, so it only
    stretches by what s x busy exceeds the pipeline's own length (`work_s`)."""
    s = core_sharing_factor(processes_per_node, num_cores)
    if s <= 1.0 or work_s <= 0:
        return 1.0
    bubble_s = estimate.breakdown_s.get("bubble", 0.0)
    busy_s = work_s - bubble_s
    return max(work_s, s * busy_s) / work_s


def _call_latencies_s(config, mine: list[SegmentCounts], m: int, units: int, tensors: int, actions: float,
                      step_model: StepModel) -> float:
    """Every collective call the step issues, each at the latency of a small message of its kind
    and group (the profile's): the fitted coefficient says how many such latencies a call costs
    inside a step, where its peers arrive late (they compute, or wait for a core)."""
    mesh = Mesh(axis_names=("pp", "dp", "tp"), shape=(config.pp, config.dp, config.tp),
                devices_per_node=step_model.devices_per_node)
    comm = step_model.comm

    def latency(op: str, axis: int) -> float:
        return comm.time_s(op, _SMALL_MESSAGE_BYTES, mesh.group(axis))

    total = 0.0
    for segment in mine:
        for op, count in segment.collectives.items():
            total += m * count * latency(op, 2)
    if config.dp > 1:
        for op, count in _dp_calls(config, units, tensors).items():
            total += count * latency(op, 1)
        total += latency("all_reduce", 1)  # the loss averaged over dp
    if config.pp > 1:
        crosses = config.dp * config.tp >= step_model.devices_per_node
        total += actions * comm.send_recv_s(_SMALL_MESSAGE_BYTES, crosses_nodes=crosses)
        total += latency("broadcast", 0)  # the loss from the last stage
    return total


def _fsdp_units(stage: StageEstimate, counts: dict[str, SegmentCounts]) -> int:
    """Segments holding parameters are FSDP units, and each stage's root is one more; where the
    root holds the first and last segments (FsdpTimeline.root_ends), those are not units."""
    names = list(stage.segment_names)
    if stage.fsdp is not None and stage.fsdp.root_ends:
        names = names[1:-1]
    return 1 + sum(1 for name in names if name in counts and counts[name].num_param_tensors)


def _dp_calls(config, units: int, tensors: int) -> dict[str, float]:
    """Gradient-synchronisation calls per step by kind: ZeRO 0 all-reduces each gradient (as
    codegen/data_parallel.py does); FSDP issues per unit an all-gather and a reduce-scatter
    (ZeRO 2: the reduce-scatter per microbatch; ZeRO 3: all per microbatch, the all-gather
    again for the backward)."""
    m = config.num_microbatches
    if config.zero_stage == 0:
        return {"all_reduce": float(tensors)}
    if config.zero_stage == 1:
        return {"all_gather": float(units), "reduce_scatter": float(units)}
    if config.zero_stage == 2:
        return {"all_gather": float(units), "reduce_scatter": float(units * m)}
    return {"all_gather": 2.0 * units * m, "reduce_scatter": float(units * m)}


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
        terms["cpu.core_sharing"] = (features.get("cpu.sharing", 1.0) - 1.0) * cpu_work_s
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

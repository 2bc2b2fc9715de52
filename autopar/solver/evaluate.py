"""Detailed cost of a sharding assignment on the original (unfolded) graph, per segment.

The ILP works on folded blocks and totals; this walks every node and edge of the graph with
the chosen strategies and returns what the pipeline planner and the reports need: per segment
the forward and backward compute, the collectives by kind and mesh axis, parameters and saved
activations per device.
"""

from __future__ import annotations

import math

from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial

from autopar.graph import OpGraph
from autopar.solver.costing import CommEvent
from autopar.solver.expert_folding import TOKEN_LOCAL, token_local_region
from autopar.solver.experts import ExpertExchange, GroupedMatmul, expert_ops_at, find_expert_ops, row_splits
from autopar.solver.quotient import Quotient
from autopar.solver.recompute import op_saved_nodes, reads_trainable_param
from autopar.solver.recompute_modules import SegmentModules, classify, mode_kinds
from autopar.solver.sharding_problem import Assignment, ProblemBuilder
from autopar.solver.tp_windows import gemm_window, with_windows
from autopar.strategies.placement import (PARTIAL, boundary_wire, grad_placement, local_weight_grad, shard_factor,
                                         transition)
from cost_model.compute import ComputeTime, is_grouped_matmul


@dataclass
class SegmentCost:
    """What one segment costs per device for one microbatch."""

    name: str
    forward: ComputeTime = field(default_factory=ComputeTime)
    backward: ComputeTime = field(default_factory=ComputeTime)
    comm: list[CommEvent] = field(default_factory=list)
    param_numel: float = 0.0
    """Trainable parameters held per device (after sharding)."""
    param_state_bytes: float = 0.0
    buffer_bytes: float = 0.0
    saved_bytes: float = 0.0
    """Activations kept for backward, per microbatch."""
    optimizer_s: float = 0.0
    output_bytes: float = 0.0
    """Size per device of the tensor(s) leaving the segment (pipeline send/recv), as sent: a
    replicated activation as each tp rank's slice (strategies/placement.boundary_wire)."""
    gathered_output_bytes: float = 0.0
    """Of those, the whole size of the replicated ones: all-gathered over tp where a later
    pipeline stage receives them."""
    input_bytes: float = 0.0
    """Size per device of activations entering from earlier segments (kept under full recompute)."""
    selective_kept: dict[str, float] = field(default_factory=dict)
    """Under selective recompute, bytes kept per producing tensor (deduplicated by name)."""
    selective_recompute: ComputeTime = field(default_factory=ComputeTime)
    """Forward time of the parameter-free ops that selective recompute re-runs."""
    expert_param_numel: float = 0.0
    """Of param_numel, the expert weights (sharded further by expert parallelism)."""
    expert_exchanges: list[ExpertExchange] = field(default_factory=list)
    """Per expert op, what expert parallelism would exchange (solver/experts.py)."""
    expert_region_comm: list[CommEvent] = field(default_factory=list)
    """Of comm, the collectives on edges into, inside and out of the MoE layers' token-local regions
    (expert_folding.token_local_region): how every tp rank gets a layer's rows whole and its output
    reduced, which Megatron-Core's per-share dispatch replaces (ExpertPricing.tp_share_dispatch)."""
    cast: ComputeTime = field(default_factory=ComputeTime)
    """Of backward, the cast of its weights' gradients from the bf16 copies to fp32 (PrecisionPolicy.
    casts_once_per_step): per microbatch, whatever the share of tokens (context parallelism)."""
    fused_wgrad_numel: float = 0.0
    """Of param_numel, the weights whose gradients the runtime can accumulate inside their linears'
    weight-gradient GEMMs (codegen/fused_wgrad.py; CUDA clusters only)."""
    fused_wgrad_saving: ComputeTime = field(default_factory=ComputeTime)
    """What backward costs less per microbatch where the configuration fuses them (StepModel.
    _fuses_wgrad: no zero-bubble schedule; under FSDP2 only where it accumulates fp32 unsharded
    gradients over microbatches): their casts, less the GEMMs' fp32 epilogues (_add_fused_saving)."""
    selective_recompute_comm: list[CommEvent] = field(default_factory=list)
    """Collectives those ops run again when recomputed (context parallelism's KV all-gather)."""
    gathered: dict[str, tuple[float, float, float, tuple]] = field(default_factory=dict)
    """Saved tensors an all-gather produced, by the key selective_kept uses: (saved bytes, bytes of
    the shard it was gathered from, seconds to gather it again in backward, (producer, placement):
    one gathered tensor saved by several consumers is one tensor, re-gathered once)."""
    op_kept: dict[str, float] = field(default_factory=dict)
    """Under the "op" mode (recompute.py), bytes kept besides the segment's inputs, by tensor."""
    op_recompute: ComputeTime = field(default_factory=ComputeTime)
    """Forward time of the ops the "op" mode re-runs (all but the kept ones)."""
    node_kept_bytes: dict[str, float] = field(default_factory=dict)
    """Per call node, its outputs as produced (and its saved extras): what the "op" machinery keeps of it."""
    node_forward: dict[str, ComputeTime] = field(default_factory=dict)
    """Per call node, its forward time (what recomputing it costs)."""
    modules: SegmentModules | None = None
    saved_by_root: dict[str, float] = field(default_factory=dict)
    """saved_bytes by the node whose storage each saved tensor is (views counted at their root)."""
    node_comm: dict[str, list[CommEvent]] = field(default_factory=dict)
    """Per call node, the non-reducing forward collectives that bring its inputs (run again where
    the node is recomputed under a selective checkpoint)."""
    """The segment's ops by module kind, for the "modules:<kinds>" modes (recompute_modules.py)."""
    activation_recompute: ComputeTime = field(default_factory=ComputeTime)
    """Forward time of the gated activations whose product saves them as a recipe and runs them
    again in backward (activation_saves.py), where the product itself is not recomputed."""
    grad_workspace_bytes: float = 0.0
    """Largest gradients alive at once while one op's backward runs: the gradient of its output
    and those of its inputs (for a language model, the fp32 logits' gradient and the one the
    log-softmax backward makes from it, at the start of the backward pass)."""
    saved_keys: set = field(default_factory=set)
    """(producer, placement) pairs already counted in saved_bytes: one tensor redistributed once
    serves every consumer that saves it (the interpreter's cache), so it is counted once."""

    @property
    def selective_saved_bytes(self) -> float:
        return sum(self.selective_kept.values())

    def regathered_saved_bytes(self, kept: dict[str, float] | None = None) -> float:
        """Saved bytes when gathered saves are kept as shards: all saves (`kept` None) or the
        kept ones of a mode."""
        if kept is None:
            return self.saved_bytes - sum(full - shard for full, shard, _ in self._distinct_gathered(None).values())
        total = 0.0
        for key, size in kept.items():
            full, shard, _, _ = self.gathered.get(key, (0.0, 0.0, 0.0, ()))
            total += shard if key in self.gathered and size <= full else size
        return total

    def regather_s(self, kept: dict[str, float] | None = None) -> float:
        """Backward all-gathers of the gathered saves (all, or those `kept` holds)."""
        return sum(seconds for _, _, seconds in self._distinct_gathered(kept).values())

    def _distinct_gathered(self, kept: dict[str, float] | None) -> dict[tuple, tuple[float, float, float]]:
        return {once: (full, shard, seconds) for key, (full, shard, seconds, once) in self.gathered.items()
                if kept is None or key in kept}

    @property
    def op_saved_bytes(self) -> float:
        return self.input_bytes + sum(self.op_kept.values())

    def modules_saved_bytes(self, mode: str) -> float:
        """Kept under "modules:<kinds>": what "none" keeps, less what it kept of the ops this mode
        runs again (saved_by_root), plus the outputs it keeps that nothing saved (a matmul
        inside a checkpointed region; recompute_modules.SegmentModules)."""
        if self.modules is None:
            return self.saved_bytes
        kinds = mode_kinds(mode)
        freed = sum(self.saved_by_root.get(name, 0.0) for name in self.modules.freed(kinds))
        added = sum(self.node_kept_bytes.get(name, 0.0) for name in self.modules.added(kinds))
        return max(self.saved_bytes - freed, 0.0) + added

    def modules_recompute(self, mode: str) -> ComputeTime:
        """Forward time of the ops "modules:<kinds>" runs again."""
        total = ComputeTime()
        for name in self.modules.recomputed(mode_kinds(mode)) if self.modules else ():
            total = total + self.node_forward.get(name, ComputeTime())
        return total

    def modules_recompute_comm(self, mode: str) -> list[CommEvent]:
        """Forward collectives that the ops "modules:<kinds>" runs again wait for (all-gathers and
        other non-reducing redistributions of their inputs: the policy keeps reductions' outputs)."""
        return [event for name in self.modules.recomputed(mode_kinds(mode)) if self.modules
                for event in self.node_comm.get(name, ())]

    def comm_s(self, phase: str) -> float:
        return sum(event.time_s for event in self.comm if event.phase == phase)


def evaluate_assignment(graph: OpGraph, quotient: Quotient, builder: ProblemBuilder,
                        assignment: Assignment) -> list[SegmentCost]:
    segment_of = {name: segment.name for segment in graph.segments for name in segment.nodes}
    first_segment = graph.segments[0].name if graph.segments else "all"
    costs: dict[str, SegmentCost] = {segment.name: SegmentCost(name=segment.name) for segment in graph.segments}
    costs.setdefault(first_segment, SegmentCost(name=first_segment))
    strategy_of = {node.name: assignment.strategies.get(quotient.rep[node.name]) for node in graph.nodes}
    consumers_segment = _first_consumer_segment(graph, segment_of, first_segment)
    mesh_shape = builder.mesh_shape
    recomputable = {node.name: is_recomputable(graph, node) for node in graph.nodes}
    op_saved = op_saved_nodes(graph)
    fanout_done: set[str] = set()
    running = expert_ops_at(find_expert_ops(graph), lambda name: _placements(strategy_of, name))
    expert_ops = {op.node: op for op in running}
    expert_params = {op.param for op in expert_ops.values()}
    region = set(token_local_region(graph, running)) if running else set()
    sums = builder.ctx.policy.tp_overlap_sums
    gemms = partial(gemm_window, forward_s=lambda node: builder.ctx.node_compute(
        node, strategy_of[node.name], builder.inputs_of(node))[0].total_s if strategy_of.get(node.name) else 0.0)
    for node in graph.nodes:
        strategy = strategy_of[node.name]
        if strategy is None:
            continue
        segment = costs[segment_of.get(node.name, consumers_segment.get(node.name, first_segment))]
        _add_node(builder, graph, node, strategy, segment, mesh_shape, recomputable[node.name], node.name in op_saved)
        if node.kind == "param" and node.requires_grad and builder.ctx.policy.casts_once_per_step \
                and builder.ctx.fused_wgrad and node.name not in expert_params:
            _add_fused_saving(builder, graph, node, strategy_of, segment)
        if node.kind == "call" and node.saved_output:
            segment.saved_keys.add((node.name, tuple(strategy.output)))  # counted by _add_node
        if node.kind == "call" and node.requires_grad:
            segment.grad_workspace_bytes = max(segment.grad_workspace_bytes,
                                               _gradient_bytes(graph, node, strategy, mesh_shape))
        if node.name in expert_params:
            segment.expert_param_numel += node.output.numel / shard_factor(strategy.output, mesh_shape)
        if node.name in expert_ops:
            segment.expert_exchanges.append(_exchange(graph, builder, node, strategy, expert_ops[node.name]))
        for index, source in enumerate(node.inputs):
            producer = graph[source]
            source_strategy = strategy_of.get(source)
            if source_strategy is None or node.kind == "output":
                continue
            fanout = assignment.fanouts.get(quotient.rep[source])
            same_group = builder.group_of.get(quotient.rep[source]) == builder.group_of.get(quotient.rep[node.name])
            if fanout is not None and not same_group:
                placement, grad = fanout
                if source not in fanout_done:
                    fanout_done.add(source)
                    events = builder.ctx.redistribute(producer.output, source_strategy.output, placement, "fwd")
                    if producer.requires_grad and producer.output.is_float:
                        target = tuple(grad_placement(p) for p in source_strategy.output)
                        events += tuple(replace(event, summed=True) for event in
                                        builder.ctx.redistribute(producer.output, grad, target, "bwd"))
                    group = builder.group_of.get(quotient.rep[source])
                    readers = [graph[name] for name in graph.consumers.get(source, ())
                               if builder.group_of.get(quotient.rep[name]) != group]
                    events = with_windows(events, producer=gemms([producer]), consumers=gemms(readers), sums=sums)
                    segment.comm += events
                    _note_node_comm(segment, node, events)
                    _note_region_comm(segment, source, node.name, events, region)
                    if _saved_by_any(graph, source) and not _views_a_weight(graph, source, placement, placement):
                        size = producer.output.nbytes / shard_factor(placement, mesh_shape)
                        _save_once(segment, (source, placement), size)
                        _keep_if(segment, source, size, not recomputable[source])
                        _note_gathered(builder, segment, source, producer, source_strategy.output, placement,
                                       mesh_shape)
                events = with_windows(builder.edge_events(producer, placement, node, strategy, index, grad),
                                      producer=gemms([producer]), consumers=gemms([node]), sums=sums)
                segment.comm += events
                _note_node_comm(segment, node, events)
                _note_region_comm(segment, source, node.name, events, region)
                target = strategy.inputs[index]
                if index in node.saved_inputs and target != placement:
                    size = producer.output.nbytes / shard_factor(target, mesh_shape)
                    _save_once(segment, (source, target), size)
                    _keep_if(segment, f"{source}->{node.name}", size, not recomputable[node.name])
                    _note_gathered(builder, segment, f"{source}->{node.name}", producer, placement, target, mesh_shape)
                _keep_reduced(segment, source, producer, placement, target, mesh_shape)
                _keep_chain_input(segment, node, source, producer, placement, recomputable, mesh_shape)
                continue
            grad_target = tuple(grad_placement(p) for p in source_strategy.output)
            events = with_windows(builder.edge_events(producer, source_strategy.output, node, strategy, index,
                                                      grad_target),
                                  producer=gemms([producer]), consumers=gemms([node]), sums=sums)
            segment.comm += events
            _note_node_comm(segment, node, events)
            _note_region_comm(segment, source, node.name, events, region)
            target = strategy.inputs[index]
            if index in node.saved_inputs and not _views_a_weight(graph, source, source_strategy.output, target):
                size = producer.output.nbytes / shard_factor(target, mesh_shape)
                key = (source, target)
                if tuple(target) == tuple(source_strategy.output):
                    key = _storage_key(graph, strategy_of, source, assignment.fanouts, quotient) or key
                _save_once(segment, key, size)
                _keep_if(segment, source, size, not recomputable[node.name])
                _note_gathered(builder, segment, source, producer, source_strategy.output, target, mesh_shape)
            _keep_reduced(segment, source, producer, source_strategy.output, target, mesh_shape)
            _keep_chain_input(segment, node, source, producer, source_strategy.output, recomputable, mesh_shape,
                              wanted=strategy.inputs[index])
    _add_boundaries(graph, costs, segment_of, strategy_of, mesh_shape)
    modules = classify(graph).segments
    for name, cost in costs.items():
        cost.modules = modules.get(name)
        by_root: dict[str, float] = {}
        for source, size in cost.saved_by_root.items():
            root = graph.storage_root(source) if source in graph.by_name else source
            by_root[root] = by_root.get(root, 0.0) + size
        cost.saved_by_root = by_root
    return [costs[segment.name] for segment in graph.segments] or list(costs.values())


def _exchange(graph: OpGraph, builder: ProblemBuilder, node, strategy, op) -> ExpertExchange:
    tokens = graph[node.inputs[op.token_input]]
    inputs = builder.inputs_of(node)
    forward, backward = builder.ctx.node_compute(node, strategy, inputs)
    experts = builder.ctx.local_experts(node, strategy, inputs)
    divisor = strategy.work_divisor(builder.mesh_shape)
    compute = builder.ctx.compute
    weight = strategy.inputs[op.weight_input]
    matmuls = tuple(_alone(GroupedMatmul(phase=phase, flops=kernel.flops / divisor, experts=experts,
                                         dtype=kernel.dtype, **builder.ctx.grouped_bytes(node, strategy, inputs,
                                                                                        kernel, weight)), compute)
                    for phase, kernels in (("fwd", node.fwd_kernels), ("bwd", node.bwd_kernels))
                    for kernel in kernels if kernel.is_matmul and is_grouped_matmul(kernel.name)
                    ) if op.kind == "grouped_mm" else ()
    return ExpertExchange(
        token_bytes=tokens.output.nbytes / shard_factor(strategy.inputs[op.token_input], builder.mesh_shape),
        output_bytes=node.output.nbytes / shard_factor(strategy.output, builder.mesh_shape),
        token_grad=tokens.requires_grad and tokens.output.is_float, dropless=op.dropless,
        compute_s=forward.total_s + backward.total_s,
        count_bytes=8.0 * op.num_experts if op.kind == "grouped_mm" else 0.0, matmuls=matmuls,
        dispatches=not op.chain_from, combines=not op.chain_to,
        rows_whole=not any(placement in row_splits(op) for placement in strategy.inputs[op.token_input]),
        device_experts=op.num_experts // math.prod(size for size, placement in
                                                   zip(builder.mesh_shape, strategy.inputs[op.weight_input])
                                                   if placement == "S0"))


def _alone(matmul: GroupedMatmul, compute) -> GroupedMatmul:
    return replace(matmul, alone_s=matmul.time_s(compute))


def _placements(strategy_of: dict, name: str) -> tuple | None:
    """A node's (output, inputs) placements; None for a token-local op (a folded MoE layer's
    rows are each tp rank's own: its chain runs, expert_folding.py)."""
    strategy = strategy_of.get(name)
    if strategy is None or strategy.name == TOKEN_LOCAL:
        return None
    return tuple(strategy.output), tuple(tuple(p) for p in strategy.inputs)


def is_recomputable(graph: OpGraph, node) -> bool:
    """Selective recompute re-runs ops without trainable parameters (attention scores, softmax,
    dropout, activations, residual adds, views); what parameterized ops save is kept."""
    if node.kind != "call":
        return False
    return not reads_trainable_param(graph, node)


def _keep_if(segment: SegmentCost, key: str, size: float, kept: bool) -> None:
    if kept:
        segment.selective_kept[key] = max(segment.selective_kept.get(key, 0.0), size)


def _gradient_bytes(graph: OpGraph, node, strategy, mesh_shape) -> float:
    """Bytes of the output gradient of `node`, of the intermediates it saves (a composite op's
    backward makes their gradients too: cross-entropy's log-probabilities, as large as the
    logits), of its inputs that need one (no view: a view's gradient is a view of its
    output's) and of the temporaries its rule's backward holds beside them
    (Strategy.backward_copies of its first input, in fp32 at least)."""
    if node.alias_input is not None:
        return 0.0
    total = sum(meta.nbytes for meta in node.outputs if meta.is_float) / shard_factor(strategy.output, mesh_shape)
    total += node.saved_extra_bytes / strategy.work_divisor(mesh_shape)
    if strategy.backward_copies and node.inputs:
        first = graph[node.inputs[0]].output  # (the temporaries are fp32 for 16-bit inputs too)
        total += (strategy.backward_copies * first.numel * max(first.itemsize_bytes, 4)
                  / shard_factor(strategy.inputs[0], mesh_shape))
    for index, source in enumerate(node.inputs):
        producer = graph[source]
        if producer.requires_grad and producer.kind != "param" and producer.outputs and producer.output.is_float:
            placement = strategy.inputs[index] if index < len(strategy.inputs) else ()
            total += producer.output.nbytes / shard_factor(placement, mesh_shape)
    return total


def _storage_key(graph: OpGraph, strategy_of: dict, name: str, fanouts: dict, quotient: Quotient) -> tuple | None:
    """The saved-tensor key of the storage `name`'s output views: up its chain of views (an
    attention output transposed and flattened for the output projection) to the op that made
    it, while no redistribution copies on the way; None when `name` is not a view."""
    node, moved = graph[name], False
    while node.kind == "call" and node.alias_input is not None and node.inputs:
        source = node.inputs[node.alias_input]
        strategy, below = strategy_of.get(node.name), strategy_of.get(source)
        if strategy is None or below is None or quotient.rep[source] in fanouts \
                or tuple(strategy.inputs[node.alias_input]) != tuple(below.output):
            break
        node, moved = graph[source], True
    return (node.name, tuple(strategy_of[node.name].output)) if moved else None


def _views_a_weight(graph: OpGraph, source: str, placement, target) -> bool:
    """A view of a parameter or buffer read where it lies (Hugging Face's transposed expert
    weights): saving it keeps the weight, no activation."""
    return graph[source].kind == "call" and tuple(placement) == tuple(target) \
        and graph[graph.storage_root(source)].kind in ("param", "buffer", "constant")


def _save_once(segment: SegmentCost, key: tuple, size: float) -> None:
    if key not in segment.saved_keys:
        segment.saved_keys.add(key)
        segment.saved_bytes += size
        segment.saved_by_root[key[0]] = segment.saved_by_root.get(key[0], 0.0) + size


def _note_gathered(builder: ProblemBuilder, segment: SegmentCost, key: str, producer, source, target,
                   mesh_shape) -> None:
    """A saved input that only all-gathers made bigger than its producer left it (a
    sequence-sharded norm output gathered for a column-parallel matmul): what keeping the shard
    saves, and the all-gather that rebuilds it in backward."""
    events = builder.ctx.redistribute(producer.output, source, target, "bwd")
    if not events or any(event.op != "all_gather" for event in events):
        return
    full = producer.output.nbytes / shard_factor(target, mesh_shape)
    shard = producer.output.nbytes / shard_factor(source, mesh_shape)
    if shard < full:
        previous = segment.gathered.get(key)
        if previous is None or previous[0] < full:
            segment.gathered[key] = (full, shard, sum(event.time_s for event in events), (producer.name, tuple(target)))


def _note_region_comm(segment: SegmentCost, source: str, consumer: str, events, region: set[str]) -> None:
    """An edge's collectives where it enters, lies in or leaves an MoE layer's token-local region
    (SegmentCost.expert_region_comm)."""
    if events and (source in region or consumer in region):
        segment.expert_region_comm += events


def _note_node_comm(segment: SegmentCost, node, events) -> None:
    """The forward, non-reducing collectives that bring `node`'s inputs (SegmentCost.node_comm)."""
    rerun = [event for event in events if event.phase == "fwd" and event.op not in ("reduce_scatter", "all_reduce")]
    if rerun and node.kind == "call":
        segment.node_comm.setdefault(node.name, []).extend(rerun)


def _keep_reduced(segment: SegmentCost, source: str, producer, placement, target, mesh_shape) -> None:
    """The "op" mode keeps what a reducing collective (reduce-scatter, all-reduce) produced, so
    backward does not run it again (torchtitan saves reduce-scatter outputs)."""
    reduces = any(src == PARTIAL and transition(src, dst) is not None for src, dst in zip(placement, target))
    if reduces and producer.outputs:
        key = f"{source}=>{','.join(target)}"
        segment.op_kept[key] = producer.output.nbytes / shard_factor(target, mesh_shape)


def _keep_chain_input(segment: SegmentCost, node, source: str, producer, placement, recomputable, mesh_shape,
                      wanted=None) -> None:
    """A recomputed op needs its inputs that are not themselves recomputed. Where the op wants
    its input more sharded than it was produced (a row-parallel output reduce-scattered onto the
    sequence, Korthikanti's sequence parallelism), codegen redistributes before the checkpoint
    and keeps the shard, so the kept size is the smaller of the two placements."""
    if recomputable.get(node.name) and not recomputable.get(source) and producer.kind in ("call", "input") \
            and producer.outputs:
        factor = shard_factor(placement, mesh_shape)
        if wanted is not None:
            factor = max(factor, shard_factor(wanted, mesh_shape))
        _keep_if(segment, source, producer.output.nbytes / factor, True)


def _add_node(builder: ProblemBuilder, graph: OpGraph, node, strategy, segment: SegmentCost, mesh_shape,
              recomputable: bool, op_saved: bool) -> None:
    if node.kind == "call":
        forward, backward = builder.ctx.node_compute(node, strategy, builder.inputs_of(node))
        segment.forward = segment.forward + forward
        segment.backward = segment.backward + backward
        _, saved = builder.node_cost_memory(node, strategy)
        segment.saved_bytes += saved
        segment.saved_by_root[node.name] = segment.saved_by_root.get(node.name, 0.0) + saved
        segment.comm += builder.ctx.op_collectives(strategy)
        if recomputable:
            segment.selective_recompute = segment.selective_recompute + forward
        else:
            _keep_if(segment, f"{node.name}:own", saved, True)
        if node.name in graph.recomputed_activations:
            segment.activation_recompute = segment.activation_recompute + forward
        # Its outputs (an attention kernel's log-sum-exp among them) are kept as produced.
        outputs = sum(meta.nbytes for meta in node.outputs) / shard_factor(strategy.output, mesh_shape)
        segment.node_kept_bytes[node.name] = outputs + node.saved_extra_bytes / strategy.work_divisor(mesh_shape)
        segment.node_forward[node.name] = forward
        if op_saved:
            segment.op_kept[f"{node.name}:out"] = segment.node_kept_bytes[node.name]
        else:
            segment.op_recompute = segment.op_recompute + forward
    elif node.kind == "param" and node.requires_grad:
        numel = node.output.numel / shard_factor(strategy.output, mesh_shape)
        segment.param_numel += numel
        segment.param_state_bytes += builder.ctx.param_state_bytes(numel)
        segment.optimizer_s += builder.ctx.optimizer_step_s(numel)
        if builder.ctx.policy.casts_once_per_step:  # the runtime's fp32 weights behind bf16 copies
            _add_gradient_cast(builder, segment, numel)
    elif node.kind in ("param", "buffer", "constant"):
        segment.buffer_bytes += node.output.nbytes / shard_factor(strategy.output, mesh_shape)


def _add_fused_saving(builder: ProblemBuilder, graph: OpGraph, param, strategy_of: dict, segment: SegmentCost) -> None:
    """A weight read only by linears whose local weight-gradient GEMM is exactly its gradient
    shard (strategies/placement.local_weight_grad; the weight used as placed) has its gradient
    accumulated inside those GEMMs where the configuration fuses (codegen/fused_wgrad.py): no
    cast per microbatch, and each GEMM's epilogue reads and writes fp32 (CostContext.fused_epilogue).
    The first microbatch's GEMM only writes fp32 (beta = 0): priced as the others (+4 bytes per
    element once per step)."""
    mesh_shape = builder.mesh_shape
    split_axes = [axis for axis, size in enumerate(mesh_shape) if size > 1]
    weight_placement = strategy_of[param.name].output
    readers = graph.consumers.get(param.name, ())
    if not readers or len(split_axes) > 1:
        return
    epilogue = ComputeTime()
    numel = param.output.numel / shard_factor(weight_placement, mesh_shape)
    for name in readers:
        reader, strategy = graph[name], strategy_of.get(name)
        if reader.kind != "call" or reader.target != "aten.linear.default" or strategy is None \
                or list(reader.inputs).count(param.name) != 1 or reader.inputs.index(param.name) != 1 \
                or tuple(strategy.inputs[1]) != tuple(weight_placement):
            return
        ndim = len(graph[reader.inputs[0]].output.shape)
        if any(not local_weight_grad(strategy.inputs[0][axis], strategy.inputs[1][axis], strategy.output[axis], ndim)
               for axis in split_axes):
            return
        epilogue = epilogue + builder.ctx.fused_epilogue(reader, strategy, builder.inputs_of(reader), numel)
    cast = _gradient_cast(builder, numel)
    segment.fused_wgrad_numel += numel
    segment.fused_wgrad_saving = segment.fused_wgrad_saving + ComputeTime(
        matmul_s=cast.matmul_s - epilogue.matmul_s, memory_s=cast.memory_s - epilogue.memory_s,
        overhead_s=cast.overhead_s)


def _gradient_cast(builder: ProblemBuilder, numel: float) -> ComputeTime:
    policy = builder.ctx.policy  # bf16 (param_bytes) read, fp32 (master_bytes) written
    return builder.ctx.compute.kernel(numel, numel * (policy.param_bytes + policy.master_bytes), False,
                                      dtype="bfloat16" if policy.param_bytes == 2 else "float32",
                                      name="aten._to_copy.default")


def _add_gradient_cast(builder: ProblemBuilder, segment: SegmentCost, numel: float) -> None:
    """Each microbatch's backward casts a weight's bf16 gradient to fp32 (PrecisionPolicy.
    casts_once_per_step): one kernel that reads 2 and writes 4 bytes per element, autograd's cast
    back from the step's bf16 copy, or FSDP2's copy-in to its fp32 reduce-scatter buffer. The
    forward cast is once per step (solver/step_model.py), and the copies are the step's."""
    cast = _gradient_cast(builder, numel)
    segment.backward = segment.backward + cast
    segment.cast = segment.cast + cast


def _first_consumer_segment(graph: OpGraph, segment_of: dict[str, str], default: str) -> dict[str, str]:
    """Placeholders (inputs, parameters) belong to the segment of their first consumer."""
    found: dict[str, str] = {}
    for node in graph.calls():
        for source in node.inputs:
            if source not in segment_of and source not in found:
                found[source] = segment_of.get(node.name, default)
    return found


def _saved_by_any(graph: OpGraph, producer: str) -> bool:
    return any(graph[consumer].inputs.index(producer) in graph[consumer].saved_inputs
               for consumer in graph.consumers.get(producer, ()) if graph[consumer].kind == "call")


def _add_boundaries(graph: OpGraph, costs: dict[str, SegmentCost], segment_of: dict[str, str],
                    strategy_of: dict, mesh_shape) -> None:
    """Bytes per device of activations produced in a segment and read by a later one."""
    order = {segment.name: position for position, segment in enumerate(graph.segments)}
    counted: set[str] = set()
    for node in graph.calls():
        for source in node.inputs:
            here, there = segment_of.get(source), segment_of.get(node.name)
            if here is None or there is None or here == there or source in counted:
                continue
            if order[there] > order[here] and graph[source].outputs:
                counted.add(source)
                meta = graph[source].output
                placement = strategy_of[source].output if strategy_of.get(source) else ()
                size = meta.nbytes / shard_factor(placement, mesh_shape)
                costs[there].input_bytes += size
                if len(mesh_shape) == 1 and len(placement) == 1:  # sent as the runtime sends it
                    wire = boundary_wire(meta.shape, placement[0], mesh_shape[0], floating=meta.is_float)
                    if wire != placement[0]:
                        costs[here].gathered_output_bytes += size
                        size = meta.nbytes / shard_factor((wire,), mesh_shape)
                costs[here].output_bytes += size


def comm_summary(events) -> dict[tuple[str, int, str], float]:
    """Seconds by (collective, axis, phase)."""
    summary: dict[tuple[str, int, str], float] = defaultdict(float)
    for event in events:
        summary[(event.op, event.axis, event.phase)] += event.time_s
    return dict(summary)

"""Turns a captured graph on a mesh into the ILP's ChoiceProblem, and reads solutions back.

Variables are of two kinds:
- op groups: an op and the trivial ops that follow it. An op with one input whose every input
  placement has a strategy needing no resharding (views, activations, dropout...) joins its
  producer's group instead of getting a variable of its own.
- fan-outs: a tensor read by several groups gets one variable choosing the placement it is
  redistributed to once and shared (DTensor redistributes once and reuses), and whether the
  consumers' gradients are accumulated as partial sums before one reduction (autograd sums the
  gradients of all consumers; a partial sum reduced once is what Megatron's f/g operators do).

Tensor parallelism without sequence parallelism (`sequence_parallel=False`, Megatron-LM without
--sequence-parallel, as in Narayanan et al. 2021): on the model-parallel axes an activation is
sharded only where a sharded weight made it so (a column-parallel output, the heads after it, a
vocabulary-parallel logit). No edge may create a shard of an activation (slice a replicated one,
reduce-scatter a partial one, move a shard to another dim), and the model's inputs arrive
replicated. Partial outputs are then all-reduced, and norms, dropouts and residual adds run
replicated on every rank of the axis. The restriction removes choices; it prices nothing.

Costs come from CostContext (forward + backward compute, resharding in both directions, the
optimizer step) and are multiplied by how many original nodes/edges a folded block stands for.
"""

from __future__ import annotations

import math

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.graph import OpGraph, OpNode, TensorMeta
from autopar.solver.costing import CostContext, total_time
from autopar.solver.intra_op import ChoiceProblem, Edge
from autopar.solver.quotient import Quotient, QuotientEdge
from autopar.strategies import Strategy, mesh_strategies
from autopar.strategies.aliasing import aliases_written_in_place
from autopar.strategies.grouped_mm import GROUPED_MM_TARGETS
from autopar.strategies.placement import (PARTIAL, REPLICATE, grad_placement, is_shard, shard, shard_dim, shard_factor,
                                         transition)


@dataclass
class OpGroup:
    """A variable: a leader node and its followers, one strategy each per choice."""

    members: list[str]
    choices: list[dict[str, Strategy]]


@dataclass
class FanOut:
    """A variable: the shared placement of a tensor read by several groups."""

    producer: str
    choices: list[tuple[tuple[str, ...], tuple[str, ...]]]
    """(placement, gradient placement) per mesh axis."""


@dataclass
class Layout:
    """How the problem's variables map back to the graph."""

    variables: list[OpGroup | FanOut]
    group_of: dict[str, int]
    fanout_of: dict[str, int] = field(default_factory=dict)

    def decode(self, choices) -> "Assignment":
        strategies: dict[str, Strategy] = {}
        fanouts: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for variable, choice in zip(self.variables, choices):
            if isinstance(variable, OpGroup):
                strategies.update(variable.choices[choice])
            else:
                fanouts[variable.producer] = variable.choices[choice]
        return Assignment(strategies=strategies, fanouts=fanouts)


@dataclass
class Assignment:
    """A strategy per representative node, and the chosen fan-out placements."""

    strategies: dict[str, Strategy]
    fanouts: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]


def placeholder_strategies(meta: TensorMeta, mesh_shape) -> list[Strategy]:
    """Replicated, or sharded on any dim that divides, on each axis."""
    per_axis = []
    for size in mesh_shape:
        options = [REPLICATE] + [shard(dim) for dim, extent in enumerate(meta.shape)
                                 if size > 1 and extent % size == 0 and extent >= size]
        per_axis.append(options)
    strategies = []
    for combo in itertools.product(*per_axis):
        if _divides(meta, combo, mesh_shape):
            strategies.append(Strategy(inputs=(), output=tuple(combo), split_axes=tuple(False for _ in combo),
                                       name="+".join(combo)))
    return strategies


FORBIDDEN_S = math.inf
"""Cost of a choice the runtime must not make: the ILP fixes its variable to 0."""


def _splits_batch(strategy: Strategy, inputs, outputs, axes) -> bool:
    """Whether the strategy shards a batch dimension on one of `axes`."""
    tensors = list(zip(strategy.inputs, inputs)) + [(strategy.output, meta) for meta in outputs]
    for placements, meta in tensors:
        for axis in axes:
            placement = placements[axis]
            if is_shard(placement) and shard_dim(placement) in meta.batch_dims:
                return True
    return False


def _divides(meta: TensorMeta, placements, mesh_shape) -> bool:
    for dim in {shard_dim(p) for p in placements if is_shard(p)}:
        pieces = 1
        for placement, size in zip(placements, mesh_shape):
            if placement == shard(dim):
                pieces *= size
        if meta.shape[dim] % pieces:
            return False
    return True


class ProblemBuilder:
    """Builds the ChoiceProblem of a (folded) graph on the mesh of `ctx`."""

    def __init__(self, graph: OpGraph, quotient: Quotient, ctx: CostContext, *,
                 memory_budget_bytes: float | None = None, memory_weight_s_per_byte: float = 1e-15,
                 grad_sync_weight: float = 1.0, fixed: dict[str, Strategy] | None = None,
                 model_parallel_axes: tuple[int, ...] = (), sequence_parallel: bool = True) -> None:
        self.graph = graph
        self.quotient = quotient
        self.ctx = ctx
        self.mesh_shape = ctx.mesh.shape
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_weight = memory_weight_s_per_byte
        self.grad_sync_weight = grad_sync_weight
        self.fixed = fixed or {}
        self.model_parallel_axes = model_parallel_axes
        """Mesh axes that split the model, never the batch (tensor parallelism; dp splits batches)."""
        self.sequence_parallel = sequence_parallel
        self.written_aliases = aliases_written_in_place(graph)
        """Tensors that share storage with one written in place: never moved (strategies/aliasing.py)."""
        """False: no activation is sharded on model_parallel_axes but as a sharded weight left it."""
        self.candidates: dict[str, list[Strategy]] = {}
        self.variables: list[OpGroup | FanOut] = []
        self.group_of: dict[str, int] = {}
        self.fanout_of: dict[str, int] = {}
        self.in_edges: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
        self.out_edges: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        self.saves: dict[str, set[int]] = {}

    # --- variables ---------------------------------------------------------------------------

    def build(self) -> tuple[ChoiceProblem, Layout]:
        for edge, multiplicity in self.quotient.edges.items():
            self.in_edges[(edge.consumer, edge.input_index)].append((edge.producer, multiplicity))
            self.out_edges[edge.producer].append((edge.consumer, edge.input_index, multiplicity))
        for name in self.quotient.order:
            node = self.graph[name]
            if node.kind == "output" or not node.outputs:
                continue
            self.saves[name] = set(node.saved_inputs)
            self._place(node)
        self._add_fanouts()
        return self._assemble(), Layout(variables=self.variables, group_of=self.group_of, fanout_of=self.fanout_of)

    def inputs_of(self, node: OpNode) -> list[TensorMeta]:
        return [self.graph[source].output for source in node.inputs]

    def _strategies(self, node: OpNode) -> list[Strategy]:
        if node.name in self.fixed:
            return [self.fixed[node.name]]
        inputs = self.inputs_of(node)
        if node.kind == "call":
            found = mesh_strategies(node, inputs, self.mesh_shape)
        else:
            found = placeholder_strategies(node.output, self.mesh_shape)
        if not self.model_parallel_axes:
            return found
        kept = [s for s in found if not _splits_batch(s, inputs, node.outputs, self.model_parallel_axes)
                and not self._splits_tokens_of_weights(node, s) and not self._splits_experts(node, inputs, s)]
        if not self.sequence_parallel and node.kind in ("input", "target"):
            kept = [s for s in kept if all(s.output[axis] == REPLICATE for axis in self.model_parallel_axes)]
        return kept or found[:1]

    def _splits_tokens_of_weights(self, node: OpNode, strategy: Strategy) -> bool:
        """On a model-parallel axis an op with a weight matrix splits that weight (column, row,
        vocab) or runs whole; splitting its tokens instead would make the axis data parallel."""
        if node.kind != "call":
            return False
        for index, source in enumerate(node.inputs):
            producer = self.graph[source]
            if producer.kind != "param" or not producer.requires_grad or len(producer.output.shape) < 2:
                continue
            for axis in self.model_parallel_axes:
                if strategy.split_axes[axis] and not is_shard(strategy.inputs[index][axis]):
                    return True
        return False

    def _splits_experts(self, node: OpNode, inputs: list[TensorMeta], strategy: Strategy) -> bool:
        """A grouped expert matmul's experts split over a model-parallel axis (its [E, K, N]
        weight sharded on E): expert parallelism's split, which it cannot combine with (rows of
        other ranks' experts would need zeros). On tp the experts run column- or row-parallel or
        whole (Megatron-Core's expert tensor parallelism), by expert only over ep ranks (or, with
        MoE parallel folding, over the tp x dp ranks)."""
        if node.target not in GROUPED_MM_TARGETS or len(inputs) < 2 or len(inputs[1].shape) != 3:
            return False
        return any(strategy.inputs[1][axis] == shard(0) for axis in self.model_parallel_axes)

    def _moves_weight(self, producer: OpNode, source, target) -> bool:
        """Weights are used where they live on model-parallel axes (gathering them is ZeRO's job)."""
        return producer.kind == "param" and any(transition(source[axis], target[axis]) is not None
                                                for axis in self.model_parallel_axes)

    def _forbidden_move(self, producer: OpNode, source, target) -> bool:
        """A redistribution the runtime must not make: moving a weight on a model-parallel axis,
        keeping a vocab-parallel lookup partial, or without sequence parallelism creating a shard
        of an activation there, or moving a tensor that something writes in place (the write
        would land in the moved copy)."""
        return (self._moves_weight(producer, source, target) or _keeps_masked_partial(producer, source, target)
                or self._shards_activation(producer, source, target)
                or (producer.name in self.written_aliases and tuple(source) != tuple(target)))

    def _shards_activation(self, producer: OpNode, source, target) -> bool:
        """Without sequence parallelism: whether the move makes (or moves) a shard of an activation
        on a model-parallel axis: slicing a replicated tensor, reduce-scattering a partial one
        (Korthikanti et al.'s sequence parallelism) or an all-to-all between dims."""
        if self.sequence_parallel or producer.kind in ("param", "buffer", "constant"):
            return False
        return any(is_shard(target[axis]) and target[axis] != source[axis] for axis in self.model_parallel_axes)

    def _place(self, node: OpNode) -> None:
        strategies = self._strategies(node)
        self.candidates[node.name] = strategies
        producer = self._single_producer(node)
        if producer is not None and producer in self.group_of and not self._starts_written_family(node, producer):
            group_index = self.group_of[producer]
            mapping = self._follow(node, producer, self.variables[group_index], strategies)
            if mapping is not None:
                group = self.variables[group_index]
                group.members.append(node.name)
                for choice, strategy in zip(group.choices, mapping):
                    choice[node.name] = strategy
                self.group_of[node.name] = group_index
                return
        self.group_of[node.name] = len(self.variables)
        self.variables.append(OpGroup(members=[node.name], choices=[{node.name: s} for s in strategies]))

    def _starts_written_family(self, node: OpNode, producer: str) -> bool:
        """A tensor written in place whose producer is not: it gets its own choice, as a follower
        it would be bound to its producer's placement, which the writer may not be able to read."""
        return node.name in self.written_aliases and producer not in self.written_aliases

    def _single_producer(self, node: OpNode) -> str | None:
        if node.kind != "call" or len(node.inputs) != 1:
            return None
        producers = self.in_edges.get((node.name, 0), [])
        return producers[0][0] if len(producers) == 1 else None

    def _follow(self, node: OpNode, producer: str, group: OpGroup, strategies: list[Strategy]) -> list[Strategy] | None:
        """For each choice of the producer's group, the cheapest strategy needing no resharding."""
        by_input: dict[tuple[str, ...], Strategy] = {}
        for strategy in strategies:
            current = by_input.get(strategy.inputs[0])
            if current is None or self._compute_s(node, strategy) < self._compute_s(node, current):
                by_input[strategy.inputs[0]] = strategy
        mapping = []
        for choice in group.choices:
            strategy = by_input.get(choice[producer].output)
            if strategy is None:
                return None
            mapping.append(strategy)
        return mapping

    def _compute_s(self, node: OpNode, strategy: Strategy) -> float:
        forward, backward = self.ctx.node_compute(node, strategy, self.inputs_of(node))
        return forward.total_s + backward.total_s

    def _other_group_consumers(self, producer: str) -> list[tuple[str, int, int]]:
        """(consumer, input index, multiplicity) of consumers outside the producer's group."""
        own = self.group_of.get(producer)
        return [(consumer, index, count) for consumer, index, count in self.out_edges.get(producer, ())
                if consumer in self.group_of and self.group_of[consumer] != own]

    def _add_fanouts(self) -> None:
        for producer in list(self.group_of):
            groups = {self.group_of[consumer] for consumer, _, _ in self._other_group_consumers(producer)}
            if len(groups) < 2:
                continue
            choices = self._fanout_choices(producer)
            self.fanout_of[producer] = len(self.variables)
            self.variables.append(FanOut(producer=producer, choices=choices))

    def _fanout_choices(self, producer: str) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        meta = self.graph[producer].output
        candidates: list[set[str]] = [set() for _ in self.mesh_shape]
        for strategy in self.candidates[producer]:
            for axis, placement in enumerate(strategy.output):
                candidates[axis].add(placement)
        for consumer, index, _ in self._other_group_consumers(producer):
            for strategy in self.candidates[consumer]:
                for axis, placement in enumerate(strategy.inputs[index]):
                    candidates[axis].add(placement)
        per_axis = []
        for axis_candidates in candidates:
            options = [(placement, grad_placement(placement)) for placement in sorted(axis_candidates)]
            if REPLICATE in axis_candidates and self.graph[producer].requires_grad:
                options.append((REPLICATE, PARTIAL))
            per_axis.append(options)
        choices = []
        for combo in itertools.product(*per_axis):
            placement = tuple(option[0] for option in combo)
            if _divides(meta, placement, self.mesh_shape):
                choices.append((placement, tuple(option[1] for option in combo)))
        return choices

    # --- costs -------------------------------------------------------------------------------

    def _assemble(self) -> ChoiceProblem:
        node_cost = [np.zeros(len(self._choices(v))) for v in self.variables]
        node_memory = [np.zeros(len(self._choices(v))) for v in self.variables]
        for index, variable in enumerate(self.variables):
            if isinstance(variable, OpGroup):
                self._group_costs(variable, node_cost[index], node_memory[index])
            else:
                self._fanout_memory(variable, node_memory[index])
        edges: dict[tuple[int, int], list[np.ndarray]] = {}
        for edge, multiplicity in self.quotient.edges.items():
            if edge.consumer in self.group_of and edge.producer in self.group_of:
                self._edge_costs(edge, multiplicity, node_cost, node_memory, edges)
        for producer, fanout_index in self.fanout_of.items():
            self._producer_to_fanout(producer, fanout_index, edges)
        edge_list = tuple(Edge(u=u, v=v, cost_s=cost, memory_bytes=memory) for (u, v), (cost, memory) in edges.items())
        names = tuple(v.members[0] if isinstance(v, OpGroup) else f"fanout:{v.producer}" for v in self.variables)
        return ChoiceProblem(node_cost_s=tuple(node_cost), node_memory_bytes=tuple(node_memory), edges=edge_list,
                             memory_budget_bytes=self.memory_budget_bytes,
                             memory_weight_s_per_byte=self.memory_weight, names=names)

    @staticmethod
    def _choices(variable) -> list:
        return variable.choices

    def _group_costs(self, group: OpGroup, cost: np.ndarray, memory: np.ndarray) -> None:
        for choice_index, choice in enumerate(group.choices):
            for name, strategy in choice.items():
                node = self.graph[name]
                count = self.quotient.count[name]
                node_cost, node_memory = self.node_cost_memory(node, strategy)
                cost[choice_index] += count * node_cost
                memory[choice_index] += count * node_memory

    def node_cost_memory(self, node: OpNode, strategy: Strategy) -> tuple[float, float]:
        """Seconds and bytes of one node (compute, optimizer step; states and saved tensors)."""
        factor = shard_factor(strategy.output, self.mesh_shape)
        if node.kind == "param":
            trainable = node.requires_grad
            numel = node.output.numel / factor
            if not trainable:
                return 0.0, node.output.nbytes / factor
            return self.grad_sync_weight * self.ctx.optimizer_step_s(numel), self.ctx.param_state_bytes(numel)
        if node.kind in ("buffer", "constant"):
            return 0.0, node.output.nbytes / factor
        if node.kind != "call":
            return 0.0, 0.0
        forward, backward = self.ctx.node_compute(node, strategy, self.inputs_of(node))
        saved = node.saved_extra_bytes / strategy.work_divisor(self.mesh_shape)
        if node.saved_output:
            saved += node.output.nbytes / factor
        own_comm_s = sum(event.time_s for event in self.ctx.op_collectives(strategy)) if strategy.collectives else 0.0
        return forward.total_s + backward.total_s + own_comm_s, saved

    def _fanout_memory(self, fanout: FanOut, memory: np.ndarray) -> None:
        producer = fanout.producer
        saved_by_someone = any(index in self.saves.get(consumer, ())
                               for consumer, index, _ in self._other_group_consumers(producer))
        if not saved_by_someone:
            return
        meta = self.graph[producer].output
        for choice_index, (placement, _) in enumerate(fanout.choices):
            memory[choice_index] += self.quotient.count[producer] * meta.nbytes / shard_factor(placement, self.mesh_shape)

    def edge_events(self, producer: OpNode, source: tuple[str, ...], consumer: OpNode, strategy: Strategy,
                    index: int, grad_target: tuple[str, ...]):
        """Forward and backward collectives on the edge producer -> consumer input `index`."""
        meta = producer.output
        target = strategy.inputs[index]
        events = list(self.ctx.redistribute(meta, source, target, "fwd"))
        if producer.kind == "param":  # a sharded weight is gathered again for backward (ZeRO-3/FSDP)
            events += [replace(event, phase="bwd") for event in events if event.op == "all_gather"]
        if producer.requires_grad and meta.is_float:
            grad = tuple(strategy.input_grad(index, axis, True) for axis in range(len(self.mesh_shape)))
            phase = "grad" if producer.kind == "param" else "bwd"
            events += self.ctx.redistribute(meta, grad, grad_target, phase)
        return events

    def _event_cost(self, events) -> float:
        return sum(event.time_s * (self.grad_sync_weight if event.phase == "grad" else 1.0) for event in events)

    def _edge_costs(self, edge: QuotientEdge, multiplicity: int, node_cost, node_memory, edges) -> None:
        producer, consumer = self.graph[edge.producer], self.graph[edge.consumer]
        consumer_var = self.group_of[edge.consumer]
        fanout = self.fanout_of.get(edge.producer)
        if fanout is None or self.group_of[edge.producer] == consumer_var:
            producer_var = self.group_of[edge.producer]
        else:
            producer_var = fanout
        saves = edge.input_index in self.saves.get(edge.consumer, ())
        meta = producer.output
        source_var = self.variables[producer_var]
        target_var = self.variables[consumer_var]
        cost = np.zeros((len(source_var.choices), len(target_var.choices)))
        memory = np.zeros_like(cost)
        for s, source_choice in enumerate(source_var.choices):
            if isinstance(source_var, FanOut):
                source, grad_target = source_choice
            else:
                source = source_choice[edge.producer].output
                grad_target = tuple(grad_placement(p) for p in source)
            for t, target_choice in enumerate(target_var.choices):
                strategy = target_choice[edge.consumer]
                events = self.edge_events(producer, source, consumer, strategy, edge.input_index, grad_target)
                cost[s, t] = multiplicity * self._event_cost(events)
                if self._forbidden_move(producer, source, strategy.inputs[edge.input_index]):
                    cost[s, t] += FORBIDDEN_S
                target = strategy.inputs[edge.input_index]
                if saves and not (isinstance(source_var, FanOut) and target == source):
                    memory[s, t] = multiplicity * meta.nbytes / shard_factor(target, self.mesh_shape)
        if producer_var == consumer_var:
            node_cost[consumer_var] += np.diag(cost)
            node_memory[consumer_var] += np.diag(memory)
            return
        _accumulate(edges, producer_var, consumer_var, cost, memory)

    def _producer_to_fanout(self, producer_name: str, fanout_index: int, edges) -> None:
        producer = self.graph[producer_name]
        group_index = self.group_of[producer_name]
        group, fanout = self.variables[group_index], self.variables[fanout_index]
        meta = producer.output
        count = self.quotient.count[producer_name]
        cost = np.zeros((len(group.choices), len(fanout.choices)))
        for s, choice in enumerate(group.choices):
            source = choice[producer_name].output
            for t, (placement, grad) in enumerate(fanout.choices):
                events = list(self.ctx.redistribute(meta, source, placement, "fwd"))
                if producer.requires_grad and meta.is_float:
                    events += self.ctx.redistribute(meta, grad, tuple(grad_placement(p) for p in source), "bwd")
                cost[s, t] = count * total_time(events)
                if self._forbidden_move(producer, source, placement):
                    cost[s, t] += FORBIDDEN_S
        _accumulate(edges, group_index, fanout_index, cost, np.zeros_like(cost))


def _keeps_masked_partial(producer: OpNode, source, target) -> bool:
    """A vocab-parallel embedding's Partial is DTensor's _MaskPartial, which DTensor (and codegen,
    interpreter._check_output) reduces before any op reads it, even a linear one with another
    Partial operand (strategies/embedding.py): no consumer may take it as Partial."""
    return producer.target.startswith("aten.embedding") and any(
        placement == PARTIAL and wanted == PARTIAL for placement, wanted in zip(source, target))


def _accumulate(edges: dict, u: int, v: int, cost: np.ndarray, memory: np.ndarray) -> None:
    if not cost.any() and not memory.any():
        return
    if (u, v) in edges:
        old_cost, old_memory = edges[(u, v)]
        edges[(u, v)] = (old_cost + cost, old_memory + memory)
    else:
        edges[(u, v)] = (cost, memory)

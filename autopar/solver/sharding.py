"""Intra-op sharding of a whole graph on a mesh: build, solve, evaluate.

    result = solve_sharding(graph, mesh, cluster)

folds identical blocks (quotient.py), builds the ILP (sharding_problem.py), solves it with a
greedy hint and a time limit (intra_op.py), and evaluates the choice on the full graph per
segment (evaluate.py). An infeasible memory budget raises InfeasiblePlanError with the least
memory any assignment needs and the tensors that dominate it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from autopar.errors import InfeasiblePlanError
from autopar.graph import OpGraph
from autopar.validation import human_bytes
from autopar.mesh import Mesh
from autopar.solver.costing import CostContext
from autopar.solver.dtensor_ops import runs_math_attention
from autopar.solver.evaluate import SegmentCost, evaluate_assignment
from autopar.solver.intra_op import ChoiceProblem, ChoiceSolution, solve_choices
from autopar.solver.quotient import fold_blocks
from autopar.solver.sharding_problem import Assignment, Layout, ProblemBuilder
from autopar.strategies import Strategy, has_rule
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel
from cost_model.memory import BF16_ADAM, PrecisionPolicy

# Ops that need no sharding rule: they create tensors from nothing or only read metadata.
_NO_RULE_NEEDED = ("aten.ones", "aten.zeros", "aten.arange", "aten.full", "aten.empty", "aten.scalar_tensor",
                   "aten.lift_fresh_copy", "aten.tril", "aten.triu", "aten.sym_size", "aten._assert", "output")


@dataclass(frozen=True, kw_only=True)
class ShardingOptions:
    """Knobs of the intra-op solve."""

    memory_budget_bytes: float | None = None
    """Per-device limit for parameters, gradients, optimizer states and saved activations."""
    memory_weight_s_per_byte: float = 1e-15
    """Tie-break: of two equally fast plans prefer the leaner (1 GB counts as 1 us)."""
    time_limit_s: float = 10.0
    """Branch-and-bound time limit (when the relaxation is fractional); the gap is reported."""
    fold_blocks: bool = True
    """Solve one block per group of identical blocks and reuse it."""
    grad_sync_weight: float = 1.0
    """Weight of per-step work (gradient sync, optimizer) relative to one microbatch."""
    use_hint: bool = True
    """Start branch-and-bound from a greedy assignment."""
    model_parallel_axes: tuple[str, ...] = ("tp",)
    """Mesh axes on which batch dimensions stay whole: tensor parallelism splits the model, the dp
    axis (or the planner's data parallelism) splits the batch."""
    sequence_parallel: bool = True
    """Whether activations may be sharded on the model-parallel axes beyond what sharded weights
    make them (Korthikanti et al.'s sequence parallelism, chosen where it is cheaper); False: tensor
    parallelism as Megatron-LM ran it before, norms and residuals replicated, partial outputs
    all-reduced (sharding_problem.py)."""


@dataclass(frozen=True, kw_only=True)
class ShardingResult:
    mesh: Mesh
    strategies: dict[str, Strategy]
    """Strategy of every node of the graph (identical blocks share their template's)."""
    assignment: Assignment
    segments: tuple[SegmentCost, ...]
    solution: ChoiceSolution
    num_variables: int
    num_edges: int
    build_time_s: float
    replicated_ops: tuple[tuple[str, int], ...]
    """Targets without a sharding rule (run replicated), with how often they occur."""

    @property
    def solve_time_s(self) -> float:
        return self.solution.solve_time_s


def cost_context(mesh: Mesh, cluster, policy: PrecisionPolicy = BF16_ADAM) -> CostContext:
    return CostContext(mesh=mesh, compute=ComputeModel(cluster.device, cluster.profile), comm=CommModel(cluster),
                       policy=policy, fused_wgrad=cluster.device_kind == "cuda",
                       math_attention=runs_math_attention(cluster.device_kind, mesh.size("tp")))


def solve_sharding(graph: OpGraph, mesh: Mesh, cluster, options: ShardingOptions = ShardingOptions(), *,
                   policy: PrecisionPolicy = BF16_ADAM, ctx: CostContext | None = None,
                   fixed: dict[str, Strategy] | None = None) -> ShardingResult:
    started = time.perf_counter()
    ctx = ctx or cost_context(mesh, cluster, policy)
    quotient = fold_blocks(graph, enabled=options.fold_blocks)
    axes = tuple(index for index, name in enumerate(mesh.axis_names) if name in options.model_parallel_axes)
    builder = ProblemBuilder(graph, quotient, ctx, memory_budget_bytes=options.memory_budget_bytes,
                             memory_weight_s_per_byte=options.memory_weight_s_per_byte,
                             grad_sync_weight=options.grad_sync_weight, fixed=fixed, model_parallel_axes=axes,
                             sequence_parallel=options.sequence_parallel)
    problem, layout = builder.build()
    if options.use_hint:
        problem = _with_hint(problem)
    build_time = time.perf_counter() - started
    solution = solve_choices(problem, time_limit_s=options.time_limit_s)
    if solution.status == "infeasible":
        raise _infeasible(graph, problem, layout, options.memory_budget_bytes)
    assignment = layout.decode(solution.choices)
    segments = evaluate_assignment(graph, quotient, builder, assignment)
    strategies = {node.name: assignment.strategies[quotient.rep[node.name]]
                  for node in graph.nodes if quotient.rep[node.name] in assignment.strategies}
    return ShardingResult(mesh=mesh, strategies=strategies, assignment=assignment, segments=tuple(segments),
                          solution=solution, num_variables=problem.num_variables, num_edges=len(problem.edges),
                          build_time_s=build_time, replicated_ops=replicated_ops(graph))


def replicated_ops(graph: OpGraph) -> tuple[tuple[str, int], ...]:
    missing = Counter(node.target for node in graph.calls()
                      if node.outputs and not has_rule(node.target) and not node.target.startswith(_NO_RULE_NEEDED))
    return tuple(sorted(missing.items(), key=lambda item: -item[1]))


def greedy_hint(problem: ChoiceProblem) -> tuple[int, ...]:
    """Variables in order, each taking the choice cheapest given the earlier ones."""
    incoming: dict[int, list] = {}
    for edge in problem.edges:
        incoming.setdefault(max(edge.u, edge.v), []).append(edge)
    choices: list[int] = []
    weight = problem.memory_weight_s_per_byte
    for v, (costs, memories) in enumerate(zip(problem.node_cost_s, problem.node_memory_bytes)):
        total = costs + weight * memories
        for edge in incoming.get(v, ()):
            if edge.u < v:
                total = total + edge.cost_s[choices[edge.u], :]
            else:
                total = total + edge.cost_s[:, choices[edge.v]]
        choices.append(int(np.argmin(total)))
    return tuple(choices)


def _with_hint(problem: ChoiceProblem) -> ChoiceProblem:
    from dataclasses import replace

    return replace(problem, hint=greedy_hint(problem))


def _infeasible(graph: OpGraph, problem: ChoiceProblem, layout: Layout, budget: float | None) -> InfeasiblePlanError:
    """The least memory any assignment needs (each variable and each edge at its leanest: a lower
    bound), and what dominates it."""
    if budget is None:  # no memory row: the placement rules themselves leave no assignment
        return InfeasiblePlanError(
            f"no sharding of {graph.model_name or 'the model'} on this mesh satisfies the placement rules: every "
            "assignment needs a move they forbid (an op with no rule for its inputs' placements, or a tensor written "
            "in place that would have to move). Constrain tp=1 (and cp=1) to plan without tensor parallelism, and "
            "report the model: its ops need a rule")
    least = sum(float(np.min(m)) for m in problem.node_memory_bytes if len(m))
    least += sum(float(np.min(edge.memory_bytes)) for edge in problem.edges
                 if edge.memory_bytes is not None and edge.memory_bytes.size)
    heaviest = sorted(((float(np.min(m)), name) for m, name in zip(problem.node_memory_bytes, problem.names) if len(m)),
                      reverse=True)[:3]
    dominant = ", ".join(f"{name} ({human_bytes(size)})" for size, name in heaviest if size > 0)
    if budget is not None and least <= budget:
        # Each op's leanest choice fits, but not together: leaner placements of one op force
        # resharded (kept) copies or heavier choices on its neighbours.
        why = (f"each op at its own leanest would need {human_bytes(least)} in all (largest: {dominant}), but those "
               "choices are not compatible: a lean placement of one op makes its neighbours keep resharded copies "
               "or heavier placements, and no combination fits")
    else:
        why = f"the leanest assignment needs at least {human_bytes(least)} per device (largest: {dominant})"
    return InfeasiblePlanError(
        f"no sharding fits in {human_bytes(budget)} per device: {why}. Use more devices, a larger memory "
        "budget, recomputation, or a smaller microbatch.")

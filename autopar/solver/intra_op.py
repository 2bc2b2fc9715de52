"""The intra-op sharding ILP, solved with OR-Tools CP-SAT.

Given variables v (op groups) with choices s in S_v (sharding strategies), choose exactly one
choice per variable:

  variables   x[v, s] in {0, 1}          v chooses strategy s
              e[u, v, s, t] in {0, 1}    on edge (u, v): u chooses s and v chooses t

  objective   minimise  sum_v sum_s (cost[v][s] + w mem[v][s]) x[v, s]
                      + sum_(u,v) sum_(s,t) (cost[u,v][s,t] + w mem[u,v][s,t]) e[u, v, s, t]
              cost: seconds of compute (forward + backward with sharded shapes), gradient and
              resharding collectives, optimizer step; w: a small price per byte so that of two
              equally fast plans the leaner wins. An infinite cost marks a choice the runtime
              cannot realise: add_one_choice / add_edge_coupling fix its variable to 0.

  constraints add_one_choice:    sum_s x[v, s] = 1                         for every v
              add_edge_coupling: sum_t e[u, v, s, t] = x[u, s]             for every edge, s
                                 sum_s e[u, v, s, t] = x[v, t]             for every edge, t
              add_memory_limit:  sum mem[v][s] x[v, s] + sum mem[u,v][s,t] e[u, v, s, t] <= budget

Costs are scaled to integers (CP-SAT is an integer solver) at a resolution chosen so that the
largest coefficient is about 1e9. The solver starts from a hint when given (e.g. Megatron's
column/row pattern), stops at a time limit, and reports the optimality gap.

This module knows nothing of torch or graphs: see sharding_problem.py for how a graph becomes
a ChoiceProblem.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

_TARGET_MAX_COEFFICIENT = 1e9
_TARGET_MAX_MEMORY_COEFFICIENT = 1e9  # larger coefficients made CP-SAT report false infeasibility


@dataclass(frozen=True, kw_only=True)
class Edge:
    """Pairwise cost between the choices of variables u and v."""

    u: int
    v: int
    cost_s: np.ndarray
    """[choices of u, choices of v] seconds."""
    memory_bytes: np.ndarray | None = None
    """[choices of u, choices of v] bytes (e.g. a resharded copy kept for backward)."""


@dataclass(frozen=True, kw_only=True)
class ChoiceProblem:
    """Pick one choice per variable; see the module docstring."""

    node_cost_s: tuple[np.ndarray, ...]
    node_memory_bytes: tuple[np.ndarray, ...]
    edges: tuple[Edge, ...] = ()
    memory_budget_bytes: float | None = None
    memory_weight_s_per_byte: float = 0.0
    hint: tuple[int, ...] | None = None
    names: tuple[str, ...] = ()

    @property
    def num_variables(self) -> int:
        return len(self.node_cost_s)

    def evaluate(self, choices) -> tuple[float, float]:
        """(cost seconds, memory bytes) of a full assignment."""
        cost = sum(float(costs[c]) for costs, c in zip(self.node_cost_s, choices))
        memory = sum(float(mems[c]) for mems, c in zip(self.node_memory_bytes, choices))
        for edge in self.edges:
            cost += float(edge.cost_s[choices[edge.u], choices[edge.v]])
            if edge.memory_bytes is not None:
                memory += float(edge.memory_bytes[choices[edge.u], choices[edge.v]])
        return cost, memory

    def objective(self, choices) -> float:
        cost, memory = self.evaluate(choices)
        return cost + self.memory_weight_s_per_byte * memory


@dataclass(frozen=True, kw_only=True)
class ChoiceSolution:
    choices: tuple[int, ...]
    cost_s: float
    memory_bytes: float
    objective: float
    """cost + memory weight x memory, in seconds."""
    best_bound: float
    """Lower bound on the objective proven by the solver."""
    status: str
    """"optimal", "feasible" (time limit hit) or "infeasible"."""
    solve_time_s: float

    @property
    def gap(self) -> float:
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.best_bound) / self.objective)


class IntraOpILP:
    """Builds the CP-SAT model of a ChoiceProblem, one method per constraint family."""

    def __init__(self, problem: ChoiceProblem) -> None:
        self.problem = problem
        self.model = cp_model.CpModel()
        self.x: list[list[cp_model.IntVar]] = []
        self.objective_terms: list[tuple[cp_model.IntVar, int]] = []
        self.memory_terms: list[tuple[cp_model.IntVar, int]] = []
        self.time_unit_s = _resolution(problem)
        self.memory_unit_bytes = _memory_resolution(problem)

    def build(self) -> "IntraOpILP":
        self.add_one_choice()
        self.add_edge_coupling()
        self.add_memory_limit()
        self.model.Minimize(sum(coefficient * var for var, coefficient in self.objective_terms))
        self._add_hint()
        return self

    def _weighted(self, cost_s: float, memory_bytes: float) -> int:
        total = cost_s + self.problem.memory_weight_s_per_byte * memory_bytes
        return int(round(total / self.time_unit_s))

    def add_one_choice(self) -> None:
        for v, (costs, memories) in enumerate(zip(self.problem.node_cost_s, self.problem.node_memory_bytes)):
            variables = [self.model.NewBoolVar(f"x[{v},{s}]") for s in range(len(costs))]
            self.model.AddExactlyOne(variables)
            self.x.append(variables)
            for s, var in enumerate(variables):
                self._term(var, float(costs[s]), float(memories[s]))

    def add_edge_coupling(self) -> None:
        for index, edge in enumerate(self.problem.edges):
            num_u, num_v = edge.cost_s.shape
            pair = [[self.model.NewBoolVar(f"e[{index},{s},{t}]") for t in range(num_v)] for s in range(num_u)]
            for s in range(num_u):
                self.model.Add(sum(pair[s]) == self.x[edge.u][s])
            for t in range(num_v):
                self.model.Add(sum(pair[s][t] for s in range(num_u)) == self.x[edge.v][t])
            for s in range(num_u):
                for t in range(num_v):
                    memory = float(edge.memory_bytes[s, t]) if edge.memory_bytes is not None else 0.0
                    self._term(pair[s][t], float(edge.cost_s[s, t]), memory)

    def add_memory_limit(self) -> None:
        if self.problem.memory_budget_bytes is None:
            return
        # Terms are rounded to the nearest unit; allowing one unit per term keeps a budget that
        # is met exactly feasible (a unit is 1e-9 of the largest figure).
        budget = int(self.problem.memory_budget_bytes // self.memory_unit_bytes) + len(self.memory_terms)
        self.model.Add(sum(coefficient * var for var, coefficient in self.memory_terms) <= budget)

    def _term(self, var, cost_s: float, memory_bytes: float) -> None:
        if not math.isfinite(cost_s):  # a forbidden choice: excluded, not priced
            self.model.Add(var == 0)
            return
        coefficient = self._weighted(cost_s, memory_bytes)
        if coefficient:
            self.objective_terms.append((var, coefficient))
        if memory_bytes and self.problem.memory_budget_bytes is not None:
            self.memory_terms.append((var, int(round(memory_bytes / self.memory_unit_bytes))))

    def _add_hint(self) -> None:
        if self.problem.hint is None:
            return
        for v, choice in enumerate(self.problem.hint):
            for s, var in enumerate(self.x[v]):
                self.model.AddHint(var, s == choice)

    def solve(self, *, time_limit_s: float = 10.0, num_workers: int = 8, deterministic: bool = False) -> ChoiceSolution:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = num_workers
        # CP-SAT's portfolio (several search strategies) proves these problems optimal in a
        # fraction of a second where one worker stalls. Parallel workers may return a different
        # one of several equally good assignments from run to run; interleaving them in one
        # thread (deterministic=True) does not, at several times the solve time.
        solver.parameters.interleave_search = deterministic
        started = time.perf_counter()
        status = solver.Solve(self.model)
        elapsed = time.perf_counter() - started
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return ChoiceSolution(choices=(), cost_s=float("inf"), memory_bytes=float("inf"), objective=float("inf"),
                                  best_bound=float("inf"), status="infeasible", solve_time_s=elapsed)
        choices = tuple(next(s for s, var in enumerate(row) if solver.Value(var)) for row in self.x)
        cost, memory = self.problem.evaluate(choices)
        bound = solver.BestObjectiveBound() * self.time_unit_s
        return ChoiceSolution(choices=choices, cost_s=cost, memory_bytes=memory,
                              objective=self.problem.objective(choices), best_bound=min(bound, self.problem.objective(choices)),
                              status="optimal" if status == cp_model.OPTIMAL else "feasible", solve_time_s=elapsed)


def solve_choices(problem: ChoiceProblem, *, time_limit_s: float = 10.0, num_workers: int = 8) -> ChoiceSolution:
    """Solve exactly (up to the time limit). Trivial problems skip the solver."""
    if all(len(costs) == 1 for costs in problem.node_cost_s):  # nothing to choose (e.g. a 1-device mesh)
        choices = tuple(0 for _ in problem.node_cost_s)
        cost, memory = problem.evaluate(choices)
        feasible = problem.memory_budget_bytes is None or memory <= problem.memory_budget_bytes
        return ChoiceSolution(choices=choices if feasible else (), cost_s=cost, memory_bytes=memory,
                              objective=problem.objective(choices), best_bound=problem.objective(choices),
                              status="optimal" if feasible else "infeasible", solve_time_s=0.0)
    return IntraOpILP(problem).build().solve(time_limit_s=time_limit_s, num_workers=num_workers)


def _largest_finite(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def _resolution(problem: ChoiceProblem) -> float:
    """Seconds per integer unit: the largest finite coefficient maps to about 1e9."""
    largest = 0.0
    weight = problem.memory_weight_s_per_byte
    for costs, memories in zip(problem.node_cost_s, problem.node_memory_bytes):
        largest = max(largest, _largest_finite(costs + weight * memories))
    for edge in problem.edges:
        memories = edge.memory_bytes if edge.memory_bytes is not None else 0.0
        largest = max(largest, _largest_finite(edge.cost_s + weight * memories))
    return max(largest / _TARGET_MAX_COEFFICIENT, 1e-15)


def _memory_resolution(problem: ChoiceProblem) -> float:
    largest = max((float(np.max(m)) for m in problem.node_memory_bytes if len(m)), default=0.0)
    largest = max([largest] + [float(np.max(e.memory_bytes)) for e in problem.edges if e.memory_bytes is not None])
    if problem.memory_budget_bytes:
        largest = max(largest, problem.memory_budget_bytes)
    return max(largest / _TARGET_MAX_MEMORY_COEFFICIENT, 1e-9)

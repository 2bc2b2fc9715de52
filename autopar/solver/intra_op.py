"""The intra-op sharding ILP, solved with OR-Tools (GLOP for the relaxation, SCIP to branch).

Given variables v (op groups) with choices s in S_v (sharding strategies), choose exactly one
choice per variable:

  variables   x[v, s] in {0, 1}          v chooses strategy s
              e[u, v, s, t] in [0, 1]    on edge (u, v): u chooses s and v chooses t

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

With binary x the coupling makes e binary too. This is the "local polytope" of a pairwise
model: on graphs that are nearly trees, as layer graphs are, its LP relaxation is usually
integral. So the relaxation is solved first (GLOP, milliseconds); an integral solution is
optimal. Otherwise (e.g. under a tight memory limit) SCIP branches from there, starting from the
hint when given, up to a time limit, and the optimality gap is reported. Choices that no
neighbour can accept are pruned first (arc consistency).

This module knows nothing of torch or graphs: see sharding_problem.py for how a graph becomes
a ChoiceProblem.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.linear_solver import pywraplp



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


_SCIP_PARAMETERS = "misc/allowweakdualreds = FALSE\n"
_MEMORY_ROW_UNIT_BYTES = 2.0**20
"""The memory row is written in MiB: in bytes its coefficients (1e8 and more) and its bound put
GLOP's relaxation outside its tolerances, and it reported feasible budgets infeasible (a 2 x 2
mesh at 256 MiB whose leanest assignment needs 177 MiB, which SCIP then solved)."""
_RELATIVE_GAP = 1e-9


class IntraOpILP:
    """Builds the linear model of a ChoiceProblem, one method per constraint family."""

    def __init__(self, problem: ChoiceProblem, *, integral: bool) -> None:
        self.problem = problem
        self.integral = integral
        self.solver = pywraplp.Solver.CreateSolver("SCIP" if integral else "GLOP")
        self.x: list[list] = []
        self.objective = self.solver.Objective()
        self.memory = None

    def build(self) -> "IntraOpILP":
        if self.problem.memory_budget_bytes is not None:
            self.memory = self.solver.Constraint(-self.solver.infinity(),
                                                 float(self.problem.memory_budget_bytes) / _MEMORY_ROW_UNIT_BYTES)
        self.add_one_choice()
        self.add_edge_coupling()
        self.add_memory_limit()
        self.objective.SetMinimization()
        return self

    def _variable(self, name: str, cost_s: float, memory_bytes: float, *, binary: bool):
        allowed = math.isfinite(cost_s)  # a forbidden choice: fixed to 0, not priced
        upper = 1.0 if allowed else 0.0
        var = self.solver.IntVar(0.0, upper, name) if binary else self.solver.NumVar(0.0, upper, name)
        if allowed:
            self.objective.SetCoefficient(var, cost_s + self.problem.memory_weight_s_per_byte * memory_bytes)
            if self.memory is not None and memory_bytes:
                self.memory.SetCoefficient(var, memory_bytes / _MEMORY_ROW_UNIT_BYTES)
        return var

    def add_one_choice(self) -> None:
        # Rows are built coefficient by coefficient: OR-Tools' expression API (Sum, ==) costs
        # several times more per term, and these models have thousands of terms.
        for v, (costs, memories) in enumerate(zip(self.problem.node_cost_s, self.problem.node_memory_bytes)):
            row = [self._variable(f"x[{v},{s}]", float(costs[s]), float(memories[s]), binary=self.integral)
                   for s in range(len(costs))]
            self._equal([(var, 1.0) for var in row], 1.0)
            self.x.append(row)

    def add_edge_coupling(self) -> None:
        for index, edge in enumerate(self.problem.edges):
            num_u, num_v = edge.cost_s.shape
            memories = edge.memory_bytes if edge.memory_bytes is not None else np.zeros_like(edge.cost_s)
            costs, memories = edge.cost_s.tolist(), memories.tolist()
            pair = [[self._variable(f"e[{index},{s},{t}]", costs[s][t], memories[s][t], binary=False)
                     for t in range(num_v)] for s in range(num_u)]
            for s in range(num_u):
                self._equal([(var, 1.0) for var in pair[s]] + [(self.x[edge.u][s], -1.0)], 0.0)
            for t in range(num_v):
                self._equal([(pair[s][t], 1.0) for s in range(num_u)] + [(self.x[edge.v][t], -1.0)], 0.0)

    def _equal(self, terms: list, value: float) -> None:
        """sum(coefficient x variable) == value."""
        row = self.solver.Constraint(value, value)
        for var, coefficient in terms:
            row.SetCoefficient(var, coefficient)

    def add_memory_limit(self) -> None:
        """The budget row was opened in build(); each variable added its bytes to it."""

    def _add_hint(self) -> None:
        if self.problem.hint is None:
            return
        variables, values = [], []
        for row, choice in zip(self.x, self.problem.hint):
            for s, var in enumerate(row):
                variables.append(var)
                values.append(1.0 if s == choice else 0.0)
        self.solver.SetHint(variables, values)

    def solve(self, *, time_limit_s: float = 10.0) -> ChoiceSolution:
        """Returns status "fractional" when the relaxation has no integral optimum."""
        parameters = pywraplp.MPSolverParameters()
        if self.integral:
            self._add_hint()
            self.solver.SetTimeLimit(int(time_limit_s * 1000))
            # SCIP's weak dual reductions can cut off every optimum of this model (its edge
            # variables are continuous): seen on 5-variable problems, tests/unit/solver/test_intra_op.py.
            self.solver.SetSolverSpecificParametersAsString(_SCIP_PARAMETERS)
            # "optimal" means proven, not OR-Tools' default of within 1e-4.
            parameters.SetDoubleParam(parameters.RELATIVE_MIP_GAP, _RELATIVE_GAP)
        started = time.perf_counter()
        status = self.solver.Solve(parameters)
        elapsed = time.perf_counter() - started
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return ChoiceSolution(choices=(), cost_s=math.inf, memory_bytes=math.inf, objective=math.inf,
                                  best_bound=math.inf, status="infeasible", solve_time_s=elapsed)
        values = [[var.solution_value() for var in row] for row in self.x]
        if not self.integral and any(1e-6 < value < 1 - 1e-6 for row in values for value in row):
            return ChoiceSolution(choices=(), cost_s=math.inf, memory_bytes=math.inf, objective=math.inf,
                                  best_bound=self.objective.Value(), status="fractional", solve_time_s=elapsed)
        choices = tuple(int(np.argmax(row)) for row in values)
        cost, memory = self.problem.evaluate(choices)
        objective = self.problem.objective(choices)
        bound = self.objective.BestBound() if self.integral else self.objective.Value()
        optimal = status == pywraplp.Solver.OPTIMAL
        return ChoiceSolution(choices=choices, cost_s=cost, memory_bytes=memory, objective=objective,
                              best_bound=min(bound, objective), status="optimal" if optimal else "feasible",
                              solve_time_s=elapsed)


def solve_choices(problem: ChoiceProblem, *, time_limit_s: float = 10.0) -> ChoiceSolution:
    """Solve exactly (up to the time limit), after dropping choices that no neighbour can accept."""
    started = time.perf_counter()
    reduced, kept = prune(problem)
    if reduced is None:
        return ChoiceSolution(choices=(), cost_s=math.inf, memory_bytes=math.inf, objective=math.inf,
                              best_bound=math.inf, status="infeasible", solve_time_s=time.perf_counter() - started)
    if all(len(costs) == 1 for costs in reduced.node_cost_s):  # nothing left to choose
        solution = _only_assignment(reduced)
    else:
        solution = _within_budget(reduced, time_limit_s)
    if solution.status == "infeasible":
        return solution
    choices = tuple(int(indices[choice]) for indices, choice in zip(kept, solution.choices))
    return ChoiceSolution(choices=choices, cost_s=solution.cost_s, memory_bytes=solution.memory_bytes,
                          objective=solution.objective, best_bound=solution.best_bound, status=solution.status,
                          solve_time_s=time.perf_counter() - started)


def _solve_ilp(problem: ChoiceProblem, time_limit_s: float) -> ChoiceSolution:
    solution = IntraOpILP(problem, integral=False).build().solve()
    if solution.status == "fractional":
        solution = IntraOpILP(problem, integral=True).build().solve(time_limit_s=time_limit_s)
    return solution


_BUDGET_RETRIES = 3


def _within_budget(problem: ChoiceProblem, time_limit_s: float) -> ChoiceSolution:
    """The solvers accept a row within their feasibility tolerance, so an assignment may exceed
    the budget by a hair (4e-6 of it, seen on a 2-variable problem): the budget row is then
    tightened by that excess and solved again, so that what is returned really fits."""
    budget = problem.memory_budget_bytes
    solution = _solve_ilp(problem, time_limit_s)
    for _ in range(_BUDGET_RETRIES):
        if budget is None or solution.status == "infeasible" or solution.memory_bytes <= budget:
            return solution
        excess = solution.memory_bytes - budget
        tightened = replace(problem, memory_budget_bytes=problem.memory_budget_bytes - 2 * excess)
        solution = _solve_ilp(tightened, time_limit_s)
        problem = tightened
    if solution.status != "infeasible" and solution.memory_bytes > budget:
        return ChoiceSolution(choices=(), cost_s=math.inf, memory_bytes=math.inf, objective=math.inf,
                              best_bound=math.inf, status="infeasible", solve_time_s=solution.solve_time_s)
    return solution


def _only_assignment(problem: ChoiceProblem) -> ChoiceSolution:
    choices = tuple(0 for _ in problem.node_cost_s)
    cost, memory = problem.evaluate(choices)
    feasible = problem.memory_budget_bytes is None or memory <= problem.memory_budget_bytes
    return ChoiceSolution(choices=choices if feasible else (), cost_s=cost, memory_bytes=memory,
                          objective=problem.objective(choices), best_bound=problem.objective(choices),
                          status="optimal" if feasible else "infeasible", solve_time_s=0.0)


def prune(problem: ChoiceProblem) -> tuple[ChoiceProblem | None, list[np.ndarray]]:
    """Arc consistency: a choice is dropped when it is forbidden (infinite cost) or when some
    edge forbids it with every remaining choice of the neighbour; repeated to a fixed point.
    Returns the smaller problem (None if a variable loses every choice) and, per variable, the
    original indices of the choices kept."""
    alive = [np.isfinite(costs) for costs in problem.node_cost_s]
    allowed = [(edge, np.isfinite(edge.cost_s)) for edge in problem.edges]
    changed = True
    while changed:
        changed = False
        for edge, finite in allowed:
            supported_u = alive[edge.u] & (finite & alive[edge.v][None, :]).any(axis=1)
            supported_v = alive[edge.v] & (finite & alive[edge.u][:, None]).any(axis=0)
            if (supported_u != alive[edge.u]).any() or (supported_v != alive[edge.v]).any():
                alive[edge.u], alive[edge.v], changed = supported_u, supported_v, True
    if any(not mask.any() for mask in alive):
        return None, []
    kept = [np.flatnonzero(mask) for mask in alive]
    edges = tuple(Edge(u=edge.u, v=edge.v, cost_s=edge.cost_s[np.ix_(kept[edge.u], kept[edge.v])],
                       memory_bytes=None if edge.memory_bytes is None
                       else edge.memory_bytes[np.ix_(kept[edge.u], kept[edge.v])]) for edge in problem.edges)
    hint = None
    if problem.hint is not None:
        hint = tuple(int(np.searchsorted(indices, choice)) if choice in indices else 0
                     for indices, choice in zip(kept, problem.hint))
    reduced = ChoiceProblem(node_cost_s=tuple(c[k] for c, k in zip(problem.node_cost_s, kept)),
                            node_memory_bytes=tuple(m[k] for m, k in zip(problem.node_memory_bytes, kept)),
                            edges=edges, memory_budget_bytes=problem.memory_budget_bytes,
                            memory_weight_s_per_byte=problem.memory_weight_s_per_byte, hint=hint,
                            names=problem.names)
    return reduced, kept

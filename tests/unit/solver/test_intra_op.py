"""The ILP against brute force on small synthetic problems."""

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autopar.solver.intra_op import ChoiceProblem, Edge, solve_choices
from autopar.solver.sharding import greedy_hint


def brute_force(problem: ChoiceProblem):
    best = None
    for choices in itertools.product(*(range(len(c)) for c in problem.node_cost_s)):
        cost, memory = problem.evaluate(choices)
        if problem.memory_budget_bytes is not None and memory > problem.memory_budget_bytes:
            continue
        objective = problem.objective(choices)
        if best is None or objective < best[0] - 1e-12:
            best = (objective, choices)
    return best


def random_problem(seed: int, *, num_vars: int, max_choices: int, budget_fraction: float | None, weight=0.0,
                   memory_scale: float = 1.0, cost_scale: float = 1.0):
    """Costs in [0, 1) x cost_scale, memories in [0, 100) x memory_scale (edges' in [0, 20))."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_choices + 1, size=num_vars)
    node_cost = tuple(cost_scale * rng.uniform(0, 1, size=n) for n in sizes)
    node_memory = tuple(memory_scale * rng.uniform(0, 100, size=n) for n in sizes)
    edges = []
    for u, v in itertools.combinations(range(num_vars), 2):
        if rng.random() < 0.5:
            memory = memory_scale * rng.uniform(0, 20, size=(sizes[u], sizes[v])) if rng.random() < 0.5 else None
            edges.append(Edge(u=u, v=v, cost_s=cost_scale * rng.uniform(0, 1, size=(sizes[u], sizes[v])),
                              memory_bytes=memory))
    budget = None
    if budget_fraction is not None:
        least = sum(m.min() for m in node_memory)
        most = sum(m.max() for m in node_memory) + sum(e.memory_bytes.max() for e in edges if e.memory_bytes is not None)
        budget = least + budget_fraction * (most - least)
    return ChoiceProblem(node_cost_s=node_cost, node_memory_bytes=node_memory, edges=tuple(edges),
                         memory_budget_bytes=budget, memory_weight_s_per_byte=weight)


@settings(max_examples=40, deadline=None)
@example(seed=318, num_vars=5, max_choices=2, budget=0.625, weight=0.0)  # SCIP's dual reductions once lost its optimum
@example(seed=5765, num_vars=5, max_choices=4, budget=None, weight=0.0)  # once stopped within OR-Tools' default 1e-4 gap
@given(seed=st.integers(0, 10_000), num_vars=st.integers(1, 5), max_choices=st.integers(1, 4),
       budget=st.one_of(st.none(), st.floats(0.2, 1.0)), weight=st.sampled_from([0.0, 1e-3]))
def test_ilp_matches_brute_force(seed, num_vars, max_choices, budget, weight):
    problem = random_problem(seed, num_vars=num_vars, max_choices=max_choices, budget_fraction=budget, weight=weight)
    expected = brute_force(problem)
    solution = solve_choices(problem, time_limit_s=10)
    if expected is None:
        assert solution.status == "infeasible"
        return
    assert solution.status == "optimal"
    # Integer scaling of coefficients (1e-9 of the largest) bounds the error.
    assert solution.objective == pytest.approx(expected[0], rel=1e-6, abs=1e-6)
    if problem.memory_budget_bytes is not None:
        assert solution.memory_bytes <= problem.memory_budget_bytes + 1e-6


@pytest.mark.parametrize("seed", [23, 29, 269])
def test_a_feasible_budget_at_real_magnitudes_is_found(seed):
    """Bytes (3e7 per unit: tensors of tens of MB) and seconds (1e-5): with the memory row in
    bytes, GLOP's relaxation called these three budgets infeasible (the row is in MiB now)."""
    problem = random_problem(seed, num_vars=6, max_choices=3, budget_fraction=0.5, memory_scale=3e7, cost_scale=1e-5)
    expected = brute_force(problem)
    assert expected is not None
    solution = solve_choices(problem, time_limit_s=10)
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(expected[0], rel=1e-6)
    assert solution.memory_bytes <= problem.memory_budget_bytes


def test_memory_budget_changes_the_choice():
    # Choice 0 is fast and fat, choice 1 slow and lean.
    problem = ChoiceProblem(node_cost_s=(np.array([1.0, 2.0]),), node_memory_bytes=(np.array([100.0, 10.0]),))
    assert solve_choices(problem).choices == (0,)
    tight = ChoiceProblem(node_cost_s=problem.node_cost_s, node_memory_bytes=problem.node_memory_bytes,
                          memory_budget_bytes=50.0)
    assert solve_choices(tight).choices == (1,)
    impossible = ChoiceProblem(node_cost_s=problem.node_cost_s, node_memory_bytes=problem.node_memory_bytes,
                               memory_budget_bytes=5.0)
    assert solve_choices(impossible).status == "infeasible"


def test_edge_costs_couple_choices():
    # Each node prefers choice 0 alone, but the edge punishes disagreement... and agreement on 0.
    edge = Edge(u=0, v=1, cost_s=np.array([[10.0, 10.0], [10.0, 0.0]]))
    problem = ChoiceProblem(node_cost_s=(np.array([0.0, 1.0]), np.array([0.0, 1.0])),
                            node_memory_bytes=(np.zeros(2), np.zeros(2)), edges=(edge,))
    solution = solve_choices(problem)
    assert solution.choices == (1, 1)
    assert solution.cost_s == pytest.approx(2.0)
    assert solution.gap == pytest.approx(0.0)


def test_greedy_hint_is_a_valid_assignment():
    problem = random_problem(7, num_vars=6, max_choices=3, budget_fraction=None)
    hint = greedy_hint(problem)
    assert len(hint) == problem.num_variables
    assert all(0 <= c < len(costs) for c, costs in zip(hint, problem.node_cost_s))
    assert solve_choices(problem).objective <= problem.objective(hint) + 1e-9


def test_an_assignment_over_the_budget_by_the_solvers_tolerance_is_not_returned():
    """Seed 1 at 0.99999 of the range: GLOP accepted (1, 1) at 4e-6 over the budget; the row is
    tightened and solved again, so the answer is brute force's (0, 1), which fits."""
    problem = random_problem(1, num_vars=2, max_choices=3, budget_fraction=0.99999)
    solution = solve_choices(problem, time_limit_s=10)
    assert solution.status == "optimal" and solution.memory_bytes <= problem.memory_budget_bytes
    assert solution.objective == pytest.approx(brute_force(problem)[0], rel=1e-6)

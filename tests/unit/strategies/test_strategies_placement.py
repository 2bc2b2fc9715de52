"""Placement strings (strategies/placement.py): which linears' local weight-gradient products are exact."""

import pytest

from autopar.strategies.placement import local_weight_grad


@pytest.mark.parametrize("inputs, weight, output, exact", [
    ("R", "R", "R", True), ("R", "S0", "S2", True), ("S2", "S1", "P", True),
    ("S0", "R", "S0", False),  # batch-sharded tokens: each device holds a partial sum
    ("S1", "S0", "S2", False), ("R", "S0", "P", False), ("S2", "S1", "S2", False)])
def test_local_products_are_exact_for_replicated_column_and_row_parallel_linears(inputs, weight, output, exact):
    assert local_weight_grad(inputs, weight, output, 3) is exact

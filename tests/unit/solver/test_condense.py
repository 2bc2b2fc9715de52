"""Condensing repeated blocks for costing (solver/condense.py): alternating kinds of block condense
together and cost as the whole graph; a pattern whose dropped blocks would feed a kept one stays whole."""

import pytest
import torch
from torch import nn

from autopar import api
from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.solver.condense import condense
from autopar.solver.sharding import ShardingOptions, solve_sharding

A100 = Cluster.from_spec("dgx-a100-80g")


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(64, width)
        self.down = nn.Linear(width, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """Blocks of two kinds (widths 128 and 192) in the order `pattern` gives ("ab", "aab", ...)."""

    def __init__(self, pattern: str, embed: bool = True):
        super().__init__()
        self.embed = nn.Embedding(100, 64) if embed else None
        self.layers = nn.ModuleList(_Block(128 if kind == "a" else 192) for kind in pattern)
        self.head = nn.Linear(64, 16)

    def forward(self, ids):
        x = self.embed(ids) if self.embed is not None else ids
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def _graph(pattern: str, embed: bool = True):
    inputs = torch.randint(0, 100, (8,)) if embed else torch.randn(8, 64)
    return api.capture_for_planning(_Stack(pattern, embed), (inputs,))


def _dangling(graph) -> list[str]:
    names = {node.name for node in graph.nodes}
    return [source for node in graph.nodes for source in node.inputs if source not in names]


def test_alternating_kinds_condense_and_cost_as_the_whole_graph():
    graph = _graph("ab" * 5)
    assert sorted(group.num_instances for group in graph.blocks) == [5, 5]
    condensed = condense(graph)
    assert len(condensed.nodes) < len(graph.nodes) and not _dangling(condensed)
    mesh = Mesh(axis_names=("tp",), shape=(2,), devices_per_node=8)
    full = solve_sharding(graph, mesh, A100, ShardingOptions(fold_blocks=False))
    small = solve_sharding(condensed, mesh, A100)
    assert small.solution.cost_s == pytest.approx(full.solution.cost_s, rel=1e-6)


def test_a_dropped_block_feeding_a_kept_one_keeps_the_groups_whole():
    """a a b a a b ...: block 3 of kind a (dropped) feeds block 1 of kind b (kept)."""
    graph = _graph("aab" * 3)
    assert sorted(group.num_instances for group in graph.blocks) == [3, 6]
    condensed = condense(graph)
    assert not _dangling(condensed)
    assert len(condensed.nodes) == len(graph.nodes)


def test_a_first_block_reading_the_input_is_not_the_template():
    """Block 0 reads the model's input (no embedding): it computes no input gradient, so folding the
    other blocks onto it would price each of them without one; block 0 stays apart."""
    graph = _graph("a" * 5, embed=False)
    mesh = Mesh(axis_names=("tp",), shape=(2,), devices_per_node=8)
    full = solve_sharding(graph, mesh, A100, ShardingOptions(fold_blocks=False)).solution.cost_s
    assert solve_sharding(graph, mesh, A100).solution.cost_s == pytest.approx(full, rel=1e-6)
    assert solve_sharding(condense(graph), mesh, A100).solution.cost_s == pytest.approx(full, rel=1e-6)

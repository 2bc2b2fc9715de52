"""Tensors written in place are never moved: a write into a moved copy is lost silently."""

from __future__ import annotations

import torch
from torch import nn

from autopar.capture.export import capture
from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.solver.sharding import solve_sharding
from autopar.strategies import mesh_strategies
from autopar.strategies.aliasing import aliases_written_in_place, writes_in_place

SLOW_GPUS = """preset = "dgx-a100-80g"
gpus_per_node = 2
[device]
fp32_tflops = 0.01
tf32_tflops = 0.01
bf16_tflops = 0.01
"""


class ChunkWriter(nn.Module):
    """Fills its output chunk by chunk, as Hugging Face's gated delta rule does
    (`core_attn_out[:, :, i] = ...`): select and slice views of a zeros_like, then copy_."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 128)
        self.out = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.proj(x).view(batch, seq, 4, 32).transpose(1, 2)
        written = torch.zeros_like(heads)
        for chunk in range(2):
            written[:, :, chunk] = heads[:, :, chunk] * 2.0
        return self.out(written.transpose(1, 2).reshape(batch, seq, 128)).square().mean()


def _graph():
    return capture(ChunkWriter(), (torch.randn(4, 8, 32),))


def test_the_family_of_a_written_tensor_reaches_its_base_and_every_view():
    graph = _graph()
    family = aliases_written_in_place(graph)
    writers = [node for node in graph.calls() if writes_in_place(node)]
    assert writers and all(node.name in family for node in writers)
    targets = {graph[name].target for name in family}
    assert {"aten.zeros_like.default", "aten.select.int", "aten.copy_.default"} <= targets
    assert "aten.linear.default" not in targets  # what is read to fill it is not written


def test_dunder_ops_do_not_write_in_place():
    graph = _graph()
    assert not [node for node in graph.calls() if node.target.startswith("aten.__") and writes_in_place(node)]


def test_no_plan_moves_a_tensor_that_is_written_in_place(tmp_path):
    graph = _graph()
    cluster_file = tmp_path / "slow.toml"
    cluster_file.write_text(SLOW_GPUS)
    mesh = Mesh(axis_names=("tp",), shape=(2,), devices_per_node=2)
    projection = next(node for node in graph.calls() if node.target == "aten.linear.default")
    column_parallel = next(strategy for strategy in mesh_strategies(projection, [graph[name].output for name in
                                                                               projection.inputs], (2,))
                           if strategy.inputs[1] == ("S0",))  # heads come out sharded, as in Qwen3.5
    result = solve_sharding(graph, mesh, Cluster.from_spec(str(cluster_file)), fixed={projection.name: column_parallel})
    assert any(strategy.split_axes[0] for strategy in result.strategies.values()), "nothing is sharded: no test"
    family = aliases_written_in_place(graph)
    moved = [(node.name, index) for node in graph.calls() if node.name in result.strategies
             for index, source in enumerate(node.inputs)
             if source in family and source in result.strategies
             and result.strategies[node.name].inputs[index] != result.strategies[source].output]
    assert not moved

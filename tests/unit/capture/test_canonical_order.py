"""capture/canonical_order.py: a model whose ops follow a set's iteration order (string hashes,
which differ per process) is captured in one order with one set of names."""

import torch
from torch import nn

from autopar.capture.export import capture_program


class PerKind(nn.Module):
    """Like Hugging Face's `for layer_type in set(config.layer_types)`: one rotary-like table per
    kind, computed in the order the kinds come."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order
        self.kinds = ("local", "global")
        for index, kind in enumerate(self.kinds):
            self.register_buffer(f"{kind}_freq", torch.arange(8.0) * (index + 1))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        tables = {}
        for kind in self.order:
            positions = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
            tables[kind] = (positions * getattr(self, f"{kind}_freq")).cos()
        return sum(self.proj(x) * tables[kind] for kind in self.kinds)


def _captured(order: list[str]):
    torch.manual_seed(0)
    return capture_program(PerKind(order), (torch.randn(2, 4, 8),))


def test_the_order_a_set_gives_does_not_change_the_graph_or_its_names():
    (first, first_graph), (second, second_graph) = _captured(["local", "global"]), _captured(["global", "local"])
    assert first_graph.fingerprint() == second_graph.fingerprint()
    assert str(first.graph) == str(second.graph)
    assert [node.name for node in first_graph.nodes] == [node.name for node in second_graph.nodes]


def test_the_canonical_program_computes_what_the_model_does():
    torch.manual_seed(0)
    model = PerKind(["global", "local"])
    x = torch.randn(2, 4, 8)
    program, _ = capture_program(model, (x,))
    torch.testing.assert_close(program.module()(x), model(x))


def test_rank_0s_planning_capture_and_each_ranks_capture_agree():
    """The plan is made from a weightless replica with the loss; each rank captures the model
    without it, in the set order its process's hashes give."""
    from autopar.plans.planning import capture_for_planning

    x = torch.randn(2, 4, 8)
    planned = capture_for_planning(PerKind(["local", "global"]), (x,), loss_fn=lambda out, y: (out - y).pow(2).mean(),
                                   example_targets=torch.randn(2, 4, 8), cache=False)
    assert _captured(["global", "local"])[1].fingerprint() == planned.fingerprint()

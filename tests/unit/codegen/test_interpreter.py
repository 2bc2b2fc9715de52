"""codegen/interpreter.py: a `with torch.no_grad():` region (export's wrap_with_set_grad_enabled
higher-order op) runs with its body read from the program, and never leaves grad mode off."""

import pytest
import torch
from torch import nn
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from autopar.codegen.interpreter import PlannedInterpreter


class Doubled(nn.Module):
    def forward(self, x):
        return x * 2


class Failing(nn.Module):
    def forward(self, x):
        raise NotImplementedError("no strategy for this op")


def _region(body: nn.Module) -> torch.fx.Node:
    """The node of `wrap_with_set_grad_enabled(False, body, x)` in a program holding `body`."""
    root = nn.Module()
    root.body = body
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(wrap_with_set_grad_enabled, (False, graph.get_attr("body"), x))
    graph.output(node)
    torch.fx.GraphModule(root, graph)
    return node


@pytest.fixture
def interpreter(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    return PlannedInterpreter({}, init_device_mesh("cpu", (1,)))


def test_a_no_grad_region_runs_its_body_without_gradients(interpreter):
    node = _region(Doubled())
    env = {"x": torch.ones(3, requires_grad=True)}
    interpreter.run_nodes([node], env)
    assert torch.equal(env[node.name], torch.full((3,), 2.0))
    assert not env[node.name].requires_grad
    assert torch.is_grad_enabled()


def test_a_failing_no_grad_region_leaves_grad_mode_on(interpreter):
    # torch's wrapper sets grad off and does not restore it when the body raises: every later
    # op (the fallback that runs it replicated included) ran without autograd.
    with pytest.raises(NotImplementedError):
        interpreter.run_nodes([_region(Failing())], {"x": torch.ones(3, requires_grad=True)})
    assert torch.is_grad_enabled()

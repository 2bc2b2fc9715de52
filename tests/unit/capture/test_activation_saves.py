"""Gated activations saved as their input (autopar/capture/activation_saves.py): the capture marks the
gating product, the cost model prices three of SwiGLU's four gate-sized tensors, and the runtime
keeps exactly that, with the gradients of eager PyTorch."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.export import capture

HIDDEN, FFN, TOKENS = 16, 48, 8


class GatedMLP(nn.Module):
    def __init__(self, activation=F.silu, reuse=False):
        super().__init__()
        self.gate, self.up = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.activation, self.reuse = activation, reuse

    def forward(self, x):
        gated = self.activation(self.gate(x))
        product = gated * self.up(x)
        return self.down(product + gated if self.reuse else product)


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


def _graph(model):
    return capture(model, (torch.randn(2, TOKENS, HIDDEN),))


def _node(graph, target):
    return next(node for node in graph.calls() if node.target == target)


@pytest.mark.parametrize("activation", [F.silu, lambda x: F.gelu(x, approximate="tanh")], ids=["swiglu", "geglu"])
def test_gated_product_saves_the_activation_as_a_recipe(activation):
    graph = _graph(GatedMLP(activation))
    act = next(node for node in graph.calls() if node.target in ("aten.silu.default", "aten.gelu.default"))
    product = _node(graph, "aten.mul.Tensor")
    folded = product.inputs.index(act.name)
    assert product.recomputed_inputs == (folded,) and folded not in product.saved_inputs
    assert len(product.saved_inputs) == 1  # the up projection
    assert graph.recomputed_activations == {act.name}
    # Saved gate-sized tensors: gate (by the activation), up (by the product), product (by down): 3, not 4
    # (the input x, which the projections save, is the model's input, not an activation).
    assert graph.saved_activation_bytes() == pytest.approx(3 * act.output.nbytes)


def test_nothing_else_is_folded():
    assert _graph(GeluMLP()).recomputed_activations == set()  # GeLU into a matmul: kept, as Megatron
    assert _graph(GatedMLP(reuse=True)).recomputed_activations == set()  # a second user needs it
    assert _graph(GatedMLP(torch.sigmoid)).recomputed_activations == set()  # saves its output


def _eager_step(model, inputs, targets):
    loss = (model(inputs) - targets).pow(2).mean()
    loss.backward()
    return loss.item(), {name: param.grad for name, param in model.named_parameters()}


def _parallel_step(model, inputs, targets):
    import autopar

    pm = autopar.parallelize(model, "cpu:procs=1", (inputs,), loss_fn=lambda out, y: (out - y).pow(2).mean(),
                             example_targets=targets, precision="fp32")
    loss = pm.train_step((inputs,), targets)
    grads = {name: param.grad for name, param in pm.named_model_parameters().items()}
    return loss.item(), grads, pm.stats.kept.get("recomputed_activation", 0)


def test_runtime_keeps_the_recipe_and_matches_eager(one_process_group):
    torch.manual_seed(0)
    model, inputs, targets = GatedMLP(), torch.randn(2, TOKENS, HIDDEN), torch.randn(2, TOKENS, HIDDEN)
    eager_loss, eager_grads = _eager_step(copy.deepcopy(model), inputs, targets)
    loss, grads, kept = _parallel_step(copy.deepcopy(model), inputs, targets)
    assert kept == 1
    assert loss == pytest.approx(eager_loss, abs=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6)


def test_the_activation_output_is_freed_after_forward(one_process_group):
    """The recipe holds no reference to the activation's output: once the segment's forward is
    over, nothing keeps it (eager autograd keeps it until backward)."""
    from autopar.codegen import recompute
    from autopar.codegen.interpreter import PlannedInterpreter
    from torch.distributed.device_mesh import init_device_mesh

    interpreter = PlannedInterpreter({}, init_device_mesh("cpu", (1,)))
    interpreter.recomputed_activations = frozenset({"act"})
    node = type("Node", (), {"name": "act", "target": torch.ops.aten.silu.default})()
    gate = torch.randn(4, FFN, requires_grad=True)
    up = torch.randn(4, FFN, requires_grad=True)

    def forward(hooked: bool):
        with recompute.compact_saves(interpreter, regather=False):
            gated = torch.ops.aten.silu.default(gate)
            if hooked:
                interpreter.on_activation(node, (gate,), {}, gated)
            product = gated * up
        alive = weakref.ref(gated)
        del gated
        gc.collect()
        return product, alive

    product, alive = forward(hooked=True)
    assert alive() is None
    product.sum().backward()
    expected_gate = torch.autograd.grad((F.silu(gate) * up).sum(), gate)[0]
    torch.testing.assert_close(gate.grad, expected_gate, rtol=0, atol=0)
    _, alive = forward(hooked=False)
    assert alive() is not None  # kept by the product's backward, as eager does

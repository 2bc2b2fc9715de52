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


def test_a_replacement_kernel_output_is_laid_out_as_the_captured_one():
    # CPU flash attention (what export records) returns (batch, heads, seq, dim) stored as
    # (batch, seq, heads, dim); the math kernel run under DTensor stores it as it is shaped. AFMoE
    # then views `out.transpose(1, 2)` as (batch, seq, hidden) with no .contiguous() between.
    from autopar.codegen.interpreter import captured_layout

    captured = torch.empty(2, 5, 4, 3).transpose(1, 2)  # shape (2, 4, 5, 3), stored as (2, 5, 4, 3)
    result = torch.randn(2, 4, 5, 3)
    with pytest.raises(RuntimeError):
        result.transpose(1, 2).view(2, 5, 12)
    relaid = captured_layout(result, captured)
    assert torch.equal(relaid, result) and relaid.stride() == captured.stride()
    assert torch.equal(relaid.transpose(1, 2).view(2, 5, 12), result.transpose(1, 2).reshape(2, 5, 12))
    assert captured_layout(relaid, captured) is relaid  # already as captured: no copy


def test_a_dtensor_whose_local_tensor_is_stored_otherwise_than_described_is_relaid(one_process_group):
    # A redistribution (an all-gather) allocates a contiguous local tensor and keeps the spec's
    # strides: a transposed tensor is then described as transposed and held contiguous, and the
    # views DTensor decides on the description fail on the local tensor (LFM2-MoE's short conv).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from autopar.codegen.interpreter import local_as_described

    mesh = init_device_mesh("cpu", (1,))
    values = torch.randn(2, 6, 4)
    described = values.transpose(1, 2)  # shape (2, 4, 6), strides (24, 1, 4)
    mislaid = DTensor.from_local(described.contiguous(), mesh, [Replicate()], shape=described.shape,
                                 stride=described.stride(), run_check=False)
    weight = DTensor.from_local(torch.randn(3, 4), mesh, [Replicate()], run_check=False)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.nn.functional.linear(mislaid.transpose(1, 2), weight)
    fixed = local_as_described(mislaid)
    assert fixed.to_local().stride() == described.stride() and torch.equal(fixed.full_tensor(), described)
    out = torch.nn.functional.linear(fixed.transpose(1, 2), weight)
    assert torch.allclose(out.full_tensor(), values @ weight.full_tensor().T)
    assert local_as_described(fixed) is fixed


def test_cpu_attention_gives_the_math_kernel_contiguous_keys(interpreter, monkeypatch):
    # One kv head expanded to every query head (stride 0, RecurrentGemma): the flash kernel export
    # records reads any strides; under DTensor on 2 ranks the math kernel's batched matmul viewed a
    # head shard of the expanded keys as (batch * heads) and failed ("view size is not compatible").
    from autopar.codegen import interpreter as module

    seen = []

    def spy(*args, **kwargs):
        seen.extend(tensor.is_contiguous() for tensor in args[:3])
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(module, "_SDPA", spy)
    query, key, value = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16)
    expanded = [tensor.expand(2, 4, 8, 16) for tensor in (key, value)]
    out = interpreter._cpu_attention(query, *expanded)
    assert seen == [True, True, True]
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(query, *expanded), atol=1e-6)


def test_a_failing_op_names_its_node_and_inputs(interpreter):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.view.default, (x, [24]))
    graph.output(node)
    with pytest.raises(RuntimeError) as raised:
        interpreter.run_nodes([node], {"x": torch.randn(6, 4).t()})
    assert any(note.startswith(f"autopar: while running {node.name} = aten.view.default(x: (4, 6) stride (1, 4)")
               for note in raised.value.__notes__)

"""Compiled float8 linears (codegen/fp8_compile.py), in one process on CPU (emulated float8)."""

from __future__ import annotations

import os

import pytest
import torch

from autopar.codegen.fp8 import Float8Linears
from autopar.codegen.fp8_compile import signature

_MORE = pytest.mark.skipif(not os.environ.get("AUTOPAR_FP8_ALL"), reason="another compile (15 s): AUTOPAR_FP8_ALL=1")


def _operands(out_features: int = 32, in_features: int = 64):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4, 8, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    grad = torch.randn(4, 8, out_features, generator=generator).to(torch.bfloat16)
    return inputs, weight, grad


def _run(fp8: Float8Linears, inputs, weight, grad):
    given, held = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    output = fp8.linear(given, held)
    output.backward(grad)
    return output.detach(), given.grad, held.grad


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=_MORE)])
def test_a_compiled_float8_linear_is_the_eager_one(recipe):
    """Inductor's fused casts (CPU backend, emulated matmul) give torchao's eager numbers exactly,
    forward and backward; a second call of the same signature reuses the compiled code."""
    inputs, weight, grad = _operands()
    eager = Float8Linears(recipe, (), torch.device("cpu"), fsdp_float8_all_gather=False)
    compiled = Float8Linears(recipe, (), torch.device("cpu"), fsdp_float8_all_gather=False, compiled=True)
    expected = _run(eager, inputs, weight, grad)
    for _ in range(2):
        got = _run(compiled, inputs, weight, grad)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert compiled.compiled and len(compiled.matmul.compiled) == 1 and not compiled.matmul.fallbacks


def test_a_signature_that_does_not_compile_runs_eagerly_and_says_why(monkeypatch):
    def failing_compile(function, **options):
        def run(*args):
            raise RuntimeError("no C++ compiler for inductor")
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    inputs, weight, grad = _operands()
    eager = Float8Linears("tensorwise", (), torch.device("cpu"), fsdp_float8_all_gather=False)
    compiled = Float8Linears("tensorwise", (), torch.device("cpu"), fsdp_float8_all_gather=False, compiled=True)
    with pytest.warns(RuntimeWarning, match="could not compile a float8 linear.*no C.. compiler.*runs torchao's "
                                            "casts eagerly"):
        got = _run(compiled, inputs, weight, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, _run(eager, inputs, weight, grad)))
    assert list(compiled.matmul.fallbacks.values()) == ["RuntimeError: no C++ compiler for inductor"]
    _run(compiled, inputs, weight, grad)  # the fallback is remembered: no second warning, no second try
    assert len(compiled.matmul.fallbacks) == 1 and not compiled.matmul.compiled


def test_each_operand_signature_compiles_on_its_own():
    inputs, weight, _ = _operands()
    other_inputs, other_weight, _ = _operands(out_features=48)
    key = signature(inputs, weight)
    assert key == signature(inputs.clone(), weight.clone())
    assert key != signature(other_inputs, other_weight)  # shapes
    assert key != signature(inputs.clone().requires_grad_(), weight)
    assert key != signature(inputs, weight.t().contiguous().t())  # strides
    with torch.no_grad():  # grad mode (a forward without autograd traces no backward)
        assert key != signature(inputs, weight)


def _compiled_graph_casts(recipe: str) -> dict[str, dict[str, int]]:
    """Float8 casts and amax reductions in the forward and the backward graph torch.compile makes of
    one float8 linear: AOTAutograd's joint graph split by the min-cut partitioner inductor uses (the
    graphs recorded, not lowered: no C++ compiler needed)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    found: dict[str, dict[str, int]] = {}

    def record(name):
        def compiler(graph_module, example_inputs):
            calls = [node for node in graph_module.graph.nodes if node.op == "call_function"]
            found[name] = {
                "casts": sum("float8" in str(node.kwargs.get("dtype", "")) for node in calls),
                "amax": sum(node.target in (torch.ops.aten.max.default, torch.ops.aten.amax.default) for node in calls)}
            return graph_module.forward
        return compiler

    linears = Float8Linears(recipe, (), torch.device("cpu"), fsdp_float8_all_gather=False)
    backend = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(linears.matmul, backend=backend, fullgraph=True)
    inputs, weight, grad = _operands()
    # the weight a parameter, as a model's is (the partitioner keeps its bf16 copy and recasts it)
    compiled(inputs.clone().requires_grad_(), torch.nn.Parameter(weight.clone())).backward(grad)
    return found


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_casts_priced_for_compiled_linears_are_the_ones_compile_keeps(recipe):
    """cost_model/fp8.py prices "compiled" casts as the joint graph runs them: tensorwise, one
    grad_output cast (its two identical casts are one) and the backward's weight cast a cast pass
    with the forward's scale (no amax); rowwise, all six casts, each with its amax."""
    from cost_model import fp8 as fp8_cost

    handling = fp8_cost.HANDLINGS["compiled"].for_recipe(recipe)
    graphs = _compiled_graph_casts(recipe)
    forward, backward = dict(handling.forward_casts), dict(handling.backward_casts)
    amax = fp8_cost.amax_counts(handling)
    assert graphs["forward"] == {"casts": sum(forward.values()), "amax": sum(forward.values())}
    assert graphs["backward"] == {"casts": sum(backward.values()),
                                  "amax": sum(amax.values()) - sum(forward.values())}
    assert (recipe == "tensorwise") == handling.weight_recast_pass_only


def _backward_rescales(recipe: str) -> tuple[int, int]:
    """(float8 matmuls, multiplications of a float8 matmul's output) in the backward graph
    torch.compile makes of torchao's float8 linear with real float8 matmuls (torch._scaled_mm runs
    on CPUs too; autopar's CPU runtime emulates them)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torchao.float8.float8_linear import Float8Linear

    from autopar.codegen.fp8 import float8_config, float8_matmul

    found: list[tuple[int, int]] = []

    def record(graph_module, example_inputs):
        matmuls = [node for node in graph_module.graph.nodes if node.target == torch.ops.aten._scaled_mm.default]
        found.append((len(matmuls), sum(user.target == torch.ops.aten.mul.Tensor
                                        for node in matmuls for user in node.users)))
        return graph_module.forward

    config = float8_config(recipe, emulate=False, fsdp_float8_all_gather=False)
    matmul = float8_matmul(Float8Linear(16, 16, bias=False, device="meta", config=config).linear_mm_config, config)
    backend = aot_autograd(fw_compiler=lambda graph_module, example_inputs: graph_module.forward, bw_compiler=record,
                           partition_fn=min_cut_rematerialization_partition)
    inputs, weight, grad = _operands()
    compiled = torch.compile(matmul, backend=backend, fullgraph=True)
    compiled(inputs.clone().requires_grad_(), torch.nn.Parameter(weight.clone())).backward(grad)
    return found[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_rescale_passes_priced_are_the_ones_torchao_runs(recipe):
    """Under rowwise scaling torchao multiplies each backward matmul's output by its scales after
    the matmul (both, in a linear compiled alone: CastHandling.rowwise_rescale_bytes); tensorwise
    scales inside it."""
    from cost_model import fp8 as fp8_cost

    handling = fp8_cost.HANDLINGS["compiled"].for_recipe(recipe)
    assert _backward_rescales(recipe) == (2, 2 if handling.rowwise_rescale_bytes else 0)

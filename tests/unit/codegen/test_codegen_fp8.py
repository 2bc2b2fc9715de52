"""The float8 linears of codegen/fp8.py against torchao's own Float8Linear, in one process."""

from __future__ import annotations

import sys

import pytest
import torch

from autopar.codegen.fp8 import Float8Linears, float8_config, require_torchao
from autopar.errors import ConfigError


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_linear_is_torchaos_float8_linear(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    reference = Float8Linear.from_float(linear, config=float8_config(recipe, emulate=True,
                                                                     fsdp_float8_all_gather=False))
    inputs = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    grad = torch.randn(4, 8, 32, dtype=torch.bfloat16)
    expected_input = inputs.clone().requires_grad_()
    reference(expected_input).backward(grad)

    fp8 = Float8Linears(recipe, ("w",), torch.device("cpu"), fsdp_float8_all_gather=False)
    weight = linear.weight.detach().clone().requires_grad_()
    bias = linear.bias.detach().clone().requires_grad_()
    given = inputs.clone().requires_grad_()
    output = fp8.linear(given, weight, bias)
    output.backward(grad)
    assert torch.equal(output, reference(inputs))
    assert torch.equal(given.grad, expected_input.grad)
    assert torch.equal(weight.grad, reference.weight.grad) and torch.equal(bias.grad, reference.bias.grad)
    assert fp8.num_calls == 1
    # Not plain bf16: the float8 rounding moves the product.
    assert not torch.equal(output, torch.nn.functional.linear(inputs, weight.detach(), bias.detach()))


def test_the_float8_all_gather_is_tensorwise_only():
    assert float8_config("tensorwise", emulate=True, fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather
    assert not float8_config("rowwise", emulate=True, fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather
    assert float8_config("rowwise", emulate=True, fsdp_float8_all_gather=False).emulate


def test_without_torchao_fp8_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match="pip install 'torchao>=0.18'"):
        require_torchao()

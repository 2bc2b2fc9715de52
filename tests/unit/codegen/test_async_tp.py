"""Async TP (codegen/async_tp.py): the emulated decomposition against DTensor's path, forward and
backward at fp64 on a one-process gloo mesh (tests/dist/test_numerics.py runs it on 2 ranks)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.codegen.async_tp import LINEAR, AsyncTP, _ColumnLinear, _RowLinear, chosen_kernel
from autopar.codegen.interpreter import PlannedInterpreter
from autopar.errors import ConfigError


@pytest.fixture
def mesh(one_process_group):
    return init_device_mesh("cpu", (1,))


def _leaf(mesh, tensor, placement):
    return DTensor.from_local(tensor.clone(), mesh, [placement], run_check=False).detach().requires_grad_(True)


def _grads(*values):
    return [value.grad.full_tensor() for value in values]


def test_column_linear_and_a_second_reader_of_the_gathered_input_match_dtensor(mesh):
    torch.manual_seed(0)
    x, w, b, w2 = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), \
        torch.randn(8, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    runner = AsyncTP(mesh, "emulate")
    fused = [_leaf(mesh, x, Shard(1)), _leaf(mesh, w, Shard(0)), _leaf(mesh, b, Shard(0)), _leaf(mesh, w2, Shard(0))]
    out, gathered = _ColumnLinear.apply(fused[0], fused[1], fused[2], runner, 1)
    assert out.placements == (Shard(2),) and gathered.placements == (Replicate(),)
    second = torch.nn.functional.linear(gathered, fused[3])
    (out.full_tensor().pow(2).sum() + second.full_tensor().pow(3).sum()).backward()
    plain = [_leaf(mesh, x, Shard(1)), _leaf(mesh, w, Shard(0)), _leaf(mesh, b, Shard(0)), _leaf(mesh, w2, Shard(0))]
    whole = plain[0].redistribute(mesh, [Replicate()])
    reference = torch.nn.functional.linear(whole, plain[1], plain[2])
    (reference.full_tensor().pow(2).sum() + torch.nn.functional.linear(whole, plain[3]).full_tensor().pow(3).sum()
     ).backward()
    torch.testing.assert_close(out.full_tensor(), reference.full_tensor(), rtol=1e-12, atol=1e-12)
    for got, expected in zip(_grads(*fused), _grads(*plain)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_row_linear_matches_dtensor_reduce_scatter(mesh):
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64), \
        torch.randn(5, dtype=torch.float64)
    fused = [_leaf(mesh, x, Shard(2)), _leaf(mesh, w, Shard(1)), _leaf(mesh, b, Replicate())]
    out = _RowLinear.apply(*fused, AsyncTP(mesh, "emulate"), 1)
    assert out.placements == (Shard(1),)
    out.full_tensor().pow(2).sum().backward()
    plain = [_leaf(mesh, x, Shard(2)), _leaf(mesh, w, Shard(1)), _leaf(mesh, b, Replicate())]
    reference = torch.nn.functional.linear(*plain).redistribute(mesh, [Shard(1)])
    reference.full_tensor().pow(2).sum().backward()
    torch.testing.assert_close(out.full_tensor(), reference.full_tensor(), rtol=1e-12, atol=1e-12)
    for got, expected in zip(_grads(*fused), _grads(*plain)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _graph():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(2, 4, 6), torch.empty(8, 6)
    column = graph.call_function(LINEAR, (x, w))
    column.meta["val"] = torch.empty(2, 4, 8)
    graph.output(column)
    return graph, column


def test_the_hook_fuses_shares_and_counts_fallbacks(mesh):
    graph, column = _graph()
    runner = AsyncTP(mesh, "emulate")
    interpreter = PlannedInterpreter({"linear": "S2|R;S0"}, mesh)
    env = {"x": _leaf(mesh, torch.randn(2, 4, 6), Shard(1)), "w": _leaf(mesh, torch.randn(8, 6), Shard(0))}
    cache = {}
    out = runner.run(column, interpreter, env, cache, "S2", ["R", "S0"])
    assert out.placements == (Shard(2),) and ("x", "R") in cache
    assert runner.run(column, interpreter, env, cache, "S2", ["R", "S0"]) is None  # the gathered input is reused
    assert runner.run(column, interpreter, env, {}, "R", ["R", "S0"]) is None  # a replicated output: DTensor's path
    assert runner.stats == {"column": 1, "shared": 1, "fallback": 1}
    assert AsyncTP(mesh, "off").run(column, interpreter, env, {}, "S2", ["R", "S0"]) is None


def test_the_kernel_defaults_to_off_on_cpu_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("AUTOPAR_ASYNC_TP", raising=False)
    assert chosen_kernel(torch.device("cpu"), "async") == "off"
    assert chosen_kernel(torch.device("cuda"), "off") == "off"
    monkeypatch.setenv("AUTOPAR_ASYNC_TP", "emulate")
    assert chosen_kernel(torch.device("cpu"), "off") == "emulate"
    monkeypatch.setenv("AUTOPAR_ASYNC_TP", "fast")
    with pytest.raises(ConfigError, match="one of off, emulate, cuda"):
        chosen_kernel(torch.device("cpu"), "async")


def test_a_bf16_step_copy_accumulates_its_weight_gradient_through_fused_wgrad(mesh):
    """Under a bf16 plan with fused weight gradients (codegen/fused_wgrad.py) the fused linear's
    backward accumulates the fp32 master's gradient itself and hands autograd none for the copy."""
    from autopar.codegen.fused_wgrad import FusedWgrad
    from autopar.codegen.program import WeightCasts

    torch.manual_seed(2)
    master = torch.nn.Parameter(DTensor.from_local(torch.randn(8, 6), mesh, [Shard(0)], run_check=False))
    x = _leaf(mesh, torch.randn(2, 4, 6).bfloat16(), Shard(1))
    casts = WeightCasts()
    runner = AsyncTP(mesh, "emulate")
    runner.fused_wgrad = FusedWgrad(casts, "emulate")
    with casts.step([(master, torch.bfloat16)]):
        copy = casts.cast(master, torch.bfloat16)
        out, gathered = _ColumnLinear.apply(x, copy.detach(), None, runner, 1, master)
        out.full_tensor().float().pow(2).sum().backward()
    assert runner.fused_wgrad.stats == {"fused": 1}
    grad_out = (2 * out.full_tensor().float()).bfloat16().float().reshape(-1, 8)
    expected = grad_out.t() @ gathered.full_tensor().float().reshape(-1, 6)
    assert master.grad.dtype == torch.float32
    torch.testing.assert_close(master.grad.full_tensor(), expected, rtol=1e-5, atol=1e-4)


def test_a_failing_cuda_kernel_falls_back_to_the_unfused_collectives_and_says_so(mesh, monkeypatch):
    """The symmetric-memory kernels have not run on a GPU here: where they fail (no symmetric
    memory, a shape they refuse), the step goes on with plain collectives, warning once."""
    import autopar.codegen.async_tp as async_tp

    def refuse(*args, **kwargs):
        raise RuntimeError("symmetric memory is not available")

    monkeypatch.setattr(async_tp, "_enable_symm_mem", refuse, raising=False)
    with pytest.warns(RuntimeWarning, match="symmetric memory is not available"):
        runner = AsyncTP(mesh, "cuda")
    assert runner.kernel == "emulate" and runner.stats["cuda_failed"] == 1
    runner.kernel = "cuda"  # set up, then the fused op itself fails (CPU tensors: it does)
    shard, right = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="run unfused"):
        gathered, product = runner.gather_matmul(shard, right, 0)
    assert runner.kernel == "emulate" and runner.stats["cuda_failed"] == 2
    torch.testing.assert_close(product, shard @ right)

"""Weight gradients accumulated into the fp32 .grad inside the weight-gradient GEMM (fused_wgrad.py),
with the emulated kernel (torch has no out_dtype matmul on CPU)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.fused_wgrad import LINEAR, FusedWgrad, chosen_kernel
from autopar.codegen.grad_overlap import OverlappedReduction, ReduceGroup
from autopar.codegen.program import WeightCasts
from autopar.errors import ConfigError


def _inputs(count: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, 5, 4, requires_grad=True) for _ in range(count)]


def _fused_steps(weight, bias, inputs, casts, fused, steps=1):
    for _ in range(steps):
        with casts.step([(weight, torch.bfloat16), (bias, torch.bfloat16)]):
            for x in inputs:
                copy, bias_copy = casts.cast(weight, torch.bfloat16), casts.cast(bias, torch.bfloat16)
                args = (x.bfloat16(), copy, bias_copy)
                master = fused.master(LINEAR, args, None)
                assert master is weight
                fused.linear(master, *args).float().pow(2).sum().backward()


def test_fp32_accumulation_of_the_same_bf16_products_across_microbatches():
    """The weight gradient is the fp32 sum of the bf16 operands' products over every microbatch
    (added to what .grad held); input and bias gradients are autograd's."""
    weight, bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
    weight.grad = torch.full_like(weight, 0.5)
    casts = WeightCasts()
    fused = FusedWgrad(casts, "emulate")
    inputs = _inputs()
    _fused_steps(weight, bias, inputs, casts, fused)
    expected = torch.full((3, 4), 0.5, dtype=torch.float64)
    for x in inputs:
        reference_x = x.detach().clone().requires_grad_(True)
        out = torch.nn.functional.linear(reference_x.bfloat16(), weight.detach().bfloat16(), bias.detach().bfloat16())
        loss_grad = (2 * out.float()).bfloat16()  # dY as the fused backward receives it
        expected += loss_grad.double().reshape(-1, 3).t() @ x.detach().bfloat16().double().reshape(-1, 4)
        out.float().pow(2).sum().backward()
        torch.testing.assert_close(x.grad, reference_x.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad.double(), expected, rtol=1e-6, atol=1e-4)
    assert weight.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32
    assert fused.stats == {"fused": 3}


def test_autograd_gets_no_weight_gradient_and_hooks_still_fire_once_per_backward():
    weight, bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
    fired = []
    weight.register_post_accumulate_grad_hook(lambda param: fired.append(param.grad.clone()))
    casts = WeightCasts()
    fused = FusedWgrad(casts, "emulate")
    with casts.step([(weight, torch.bfloat16)]):
        copy = casts.cast(weight, torch.bfloat16)
        x = torch.randn(5, 4).bfloat16()
        out = fused.linear(fused.master(LINEAR, (x, copy), None), x, copy)
        (handed,) = torch.autograd.grad(out.float().sum(), weight, allow_unused=True)
        assert handed is None  # nothing for autograd to accumulate: the GEMM wrote .grad
        assert weight.grad is not None and not fired  # autograd.grad runs no AccumulateGrad
        weight.grad = None
        fused.linear(weight, x, copy).float().sum().backward()
    assert len(fired) == 1 and torch.equal(fired[0], weight.grad)


def test_only_step_copies_of_accumulating_casts_fuse():
    weight = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(5, 4).bfloat16()
    casts = WeightCasts()
    assert FusedWgrad(casts, "emulate").master(LINEAR, (x, weight.bfloat16()), None) is None  # no step
    with casts.step([(weight, torch.bfloat16)]):
        copy = casts.cast(weight, torch.bfloat16)
        assert FusedWgrad(casts, "off").master(LINEAR, (x, copy), None) is None
        assert FusedWgrad(casts, "emulate").master(torch.ops.aten.mm.default, (x, copy), None) is None
        assert FusedWgrad(casts, "emulate").master(LINEAR, (x.float(), copy), None) is None
    zero_bubble = WeightCasts(accumulate_into_grad=False)  # torch's weight pass adds the gradients itself
    with zero_bubble.step([(weight, torch.bfloat16)]):
        assert FusedWgrad(zero_bubble, "emulate").master(LINEAR, (x, zero_bubble.cast(weight, torch.bfloat16)), None) is None


def test_the_kernel_defaults_to_off_on_cpu_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("AUTOPAR_FUSED_WGRAD", raising=False)
    assert chosen_kernel(torch.device("cpu")) == "off"
    monkeypatch.setenv("AUTOPAR_FUSED_WGRAD", "emulate")
    assert chosen_kernel(torch.device("cpu")) == "emulate"
    monkeypatch.setenv("AUTOPAR_FUSED_WGRAD", "fast")
    with pytest.raises(ConfigError, match="one of off, emulate, cuda"):
        chosen_kernel(torch.device("cpu"))


def test_grad_overlap_sees_every_fused_accumulation(one_process_group):
    """ZeRO-0's overlapped all-reduce counts one accumulation per backward of a fused weight (the
    weight's AccumulateGrad still runs), and reduces the full fp32 sum once it is complete."""
    weight, bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
    reduction = OverlappedReduction({id(p): (p, ReduceGroup(dist.group.WORLD, 1)) for p in (weight, bias)})
    casts = WeightCasts()
    fused = FusedWgrad(casts, "emulate")
    inputs = _inputs()
    for step in range(2):
        weight.grad = bias.grad = None
        reduction.begin_step()
        _fused_steps(weight, bias, inputs, casts, fused)
        done = reduction.finish()
        assert done == (set() if step == 0 else {id(weight), id(bias)})  # the first step counts
    assert reduction._expected == {id(weight): 3, id(bias): 3}
    assert reduction.num_overlapped >= 1  # the second step reduced during backward
    unreduced, unreduced_bias = nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())
    alone = WeightCasts()
    _fused_steps(unreduced, unreduced_bias, inputs, alone, FusedWgrad(alone, "emulate"))
    torch.testing.assert_close(weight.grad, unreduced.grad)


def test_a_recomputed_linear_accumulates_once_per_backward():
    """Under activation checkpointing (non-reentrant, as the runtime's recompute modes) the forward
    runs again in backward but the weight gradient is accumulated once, equal to the plain run's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    weight = torch.randn(3, 4)
    weights = [nn.Parameter(weight.clone()) for _ in range(2)]
    biases = [nn.Parameter(torch.zeros(3)) for _ in range(2)]
    inputs = _inputs(2)
    runs = []
    for weight, bias, recompute in ((weights[0], biases[0], False), (weights[1], biases[1], True)):
        casts = WeightCasts()
        fused = FusedWgrad(casts, "emulate")
        with casts.step([(weight, torch.bfloat16), (bias, torch.bfloat16)]):
            for x in inputs:
                copy, bias_copy = casts.cast(weight, torch.bfloat16), casts.cast(bias, torch.bfloat16)
                run = lambda value: fused.linear(weight, value, copy, bias_copy)  # noqa: E731
                value = x.detach().bfloat16().requires_grad_(True)
                out = checkpoint(run, value, use_reentrant=False) if recompute else run(value)
                out.float().pow(2).sum().backward()
        runs.append(fused.stats)
    assert runs == [{"fused": 2}, {"fused": 2}]
    torch.testing.assert_close(weights[0].grad, weights[1].grad, rtol=0, atol=0)
    torch.testing.assert_close(biases[0].grad, biases[1].grad, rtol=0, atol=0)


def test_the_cuda_kernel_calls_are_well_formed_on_meta_tensors():
    """The "cuda" kernel's out_dtype matmuls (no CPU kernel; meta checks their signatures, shapes
    and dtypes): the first microbatch writes a new fp32 gradient, later ones accumulate into it in place."""
    fused = FusedWgrad(WeightCasts(), "cuda")
    weight = nn.Parameter(torch.empty(3, 4, device="meta"))
    grad = torch.empty(2, 5, 3, device="meta", dtype=torch.bfloat16)
    inputs = torch.empty(2, 5, 4, device="meta", dtype=torch.bfloat16)
    fused.accumulate(weight, grad, inputs)
    first = weight.grad
    assert first.dtype == torch.float32 and first.shape == (3, 4)
    fused.accumulate(weight, grad, inputs)
    assert weight.grad is first and fused.stats == {"fused": 2}


class _FakeFsdp(nn.Module):
    """A module with FSDP2's private state as fused_wgrad.FsdpGradients reads it (one gathered bf16
    parameter; its group's gradient sync set by the test)."""

    def __init__(self, param: nn.Parameter) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.fsdp_param = SimpleNamespace(_unsharded_param=param, unsharded_accumulated_grad=None)
        self.group = SimpleNamespace(fsdp_params=[self.fsdp_param], reduce_grads=False)
        self.state = SimpleNamespace(_fsdp_param_group=self.group)

    def _get_fsdp_state(self):
        return self.state


def test_under_fsdp2_the_gemm_accumulates_into_its_fp32_unsharded_gradient_while_it_accumulates():
    """FSDP2's gathered bf16 parameter: the first microbatch without gradient sync creates the fp32
    unsharded gradient, later ones add into it (also the one that syncs); autograd gets nothing. A
    backward that syncs with no accumulated gradient hands autograd the bf16 gradient (FSDP2
    reduce-scatters it as unfused); outside a step nothing fuses."""
    gathered = nn.Parameter(torch.randn(3, 4).bfloat16())
    module, casts = _FakeFsdp(gathered), WeightCasts()
    fused = FusedWgrad(casts, "emulate")
    fused.use_fsdp([module])
    inputs = [x.detach().bfloat16() for x in _inputs()]
    expected = torch.zeros(3, 4, dtype=torch.float64)
    assert fused.master(LINEAR, (inputs[0], gathered), None) is None  # no step
    with casts.step():
        for index, x in enumerate(inputs):
            module.group.reduce_grads = index == len(inputs) - 1
            assert fused.master(LINEAR, (x, gathered), None) is gathered
            out = fused.linear(gathered, x, gathered)
            out.float().pow(2).sum().backward()
            expected += (2 * out.float()).bfloat16().double().reshape(-1, 3).t() @ x.double().reshape(-1, 4)
            assert gathered.grad is None
        accumulated = module.fsdp_param.unsharded_accumulated_grad
        assert accumulated.dtype == torch.float32
        torch.testing.assert_close(accumulated.double(), expected, rtol=1e-6, atol=1e-4)
        module.fsdp_param.unsharded_accumulated_grad = None  # FSDP2 reduce-scattered it
        fused.linear(gathered, inputs[0], gathered).float().sum().backward()
    assert module.fsdp_param.unsharded_accumulated_grad is None and gathered.grad.dtype == torch.bfloat16
    assert fused.stats == {"fused": 3}


def test_without_fsdp2_private_state_nothing_fuses_and_the_fallback_is_counted():
    gathered = nn.Parameter(torch.randn(3, 4).bfloat16())
    module, casts = _FakeFsdp(gathered), WeightCasts()
    del module.group.reduce_grads
    fused = FusedWgrad(casts, "emulate")
    fused.use_fsdp([module])
    with casts.step():
        assert fused.master(LINEAR, (torch.randn(5, 4).bfloat16(), gathered), None) is None
    assert fused.stats == {"fallback": 1}

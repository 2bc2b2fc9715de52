"""The overlapped ZeRO-0 gradient all-reduce on a one-process group: buckets by completion order,
issued during backward once their weights are complete, divided, written back; the counting step
issues nothing; a late accumulation is reduced again."""

import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.grad_overlap import OverlappedReduction, ReduceGroup
from autopar.codegen.main_grad import accumulating_copy


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, reduction, inputs, microbatches=2, probe=None):
    reduction.begin_step()
    for index in range(microbatches):
        x = inputs[index].clone().requires_grad_(True)
        if probe is not None and index == microbatches - 1:
            x.register_hook(lambda grad: probe.append(reduction.num_overlapped))
        model(x).square().mean().backward()
    return reduction.finish()


def test_buckets_are_issued_during_the_last_backward_and_divided(one_process_group):
    model = _model()
    where = {id(p): (p, ReduceGroup(dist.group.WORLD, 2)) for p in model.parameters()}
    reduction = OverlappedReduction(where, bucket_bytes=40)  # a few weights per bucket
    inputs = torch.randn(2, 3, 4)
    assert _step(model, reduction, inputs) == set()  # the counting step reduces nothing itself
    assert reduction.num_overlapped == 0
    model.zero_grad()
    seen: list[int] = []
    done = _step(model, reduction, inputs, probe=seen)
    expected = _model()
    for index in range(2):
        expected(inputs[index]).square().mean().backward()
    assert done == {id(p) for p in model.parameters()}
    assert seen and seen[0] > 0  # issued before backward reached the inputs
    for got, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(got.grad, want.grad / 2)  # summed over one rank, divided by 2


def test_buckets_follow_completion_order_within_the_byte_cap(one_process_group):
    model = _model()
    where = {id(p): (p, ReduceGroup(dist.group.WORLD, 1)) for p in model.parameters()}
    reduction = OverlappedReduction(where, bucket_bytes=64)
    _step(model, reduction, torch.randn(2, 3, 4))
    order = [p for bucket in reduction._buckets for p in bucket.params]
    assert order[0] is model[2].bias or order[0] is model[2].weight  # the last layer completes first
    assert order[-1] in (model[0].weight, model[0].bias)
    assert all(sum(p.numel() * 4 for p in b.params) <= 64 or len(b.params) == 1 for b in reduction._buckets)


def test_copies_that_accumulate_into_grad_are_counted_once_per_backward(one_process_group):
    weight = nn.Parameter(torch.randn(3, 3))
    reduction = OverlappedReduction({id(weight): (weight, ReduceGroup(dist.group.WORLD, 1))})
    for _ in range(2):
        reduction.begin_step()
        for _ in range(3):  # three microbatches through one bf16 copy
            copy = accumulating_copy(weight, torch.bfloat16)
            (torch.ones(3, dtype=torch.bfloat16) @ copy).float().sum().backward()
        reduction.finish()
    assert reduction._expected == {id(weight): 3}
    assert reduction.num_overlapped == 1


def test_a_weight_accumulated_after_its_bucket_left_is_reduced_again(one_process_group):
    model = _model()
    where = {id(p): (p, ReduceGroup(dist.group.WORLD, 1)) for p in model.parameters()}
    reduction = OverlappedReduction(where)
    inputs = torch.randn(3, 3, 4)
    _step(model, reduction, inputs, microbatches=2)
    model.zero_grad()
    _step(model, reduction, inputs, microbatches=3)  # one more accumulation than counted
    expected = _model()
    for index in range(3):
        expected(inputs[index]).square().mean().backward()
    for got, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(got.grad, want.grad)

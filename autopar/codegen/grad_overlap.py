"""ZeRO-0's data-parallel gradient all-reduce, overlapped with the step's last backward.

Without FSDP every rank holds whole gradients and data parallelism averages them with an
all-reduce over the ranks that hold the same weights. torch's DDP and Megatron-LM's DDP do not
wait for the end of backward: gradients are grouped into buckets, and a bucket's all-reduce is
issued (asynchronously) as soon as its last gradient is complete, so that it runs while backward
computes the gradients of earlier layers. This module does the same for autopar's runtime, and
the planner prices it so (solver/step_tail.py `_dp_sync_exposed_s`: only what outlasts the last
backward is exposed).

When is a gradient complete? A weight's gradient is accumulated once per backward pass that reads
it: once per microbatch, once per pipeline chunk reading it, however many ops read it inside one
pass (autograd sums those first). The count per step is a property of the plan, not of the data,
so it is counted during the first step, which reduces everything after backward as before; from
the second step on a weight is complete at its counted accumulation, and the buckets follow the
order in which the first step completed the weights (DDP rebuilds its buckets the same way).

Every rank of a group must issue the same collectives in the same order. Buckets are issued
strictly in order (a ready bucket waits for the earlier ones), and a bucket not ready when
backward ends (a weight that no token reached on this rank in this step) is issued at the end,
in order, with its missing gradients as zeros: the same sequence of all-reduces on every rank.
A weight accumulated again after its bucket left (a plan whose structure changed) is reduced
again from its gradient at the end, with the bucket's old result discarded.

Events come from `register_post_accumulate_grad_hook`, which fires after each backward pass's
accumulation into a weight, also where the step's bf16 copy added into `.grad` itself
(main_grad.AccumulatingCast: the weight's AccumulateGrad node still runs after it). Weights
whose gradients torch's zero-bubble weight pass adds by hand report nothing, are never counted,
and stay with the reduction after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per bucket: torch DDP's default `bucket_cap_mb` (25); a larger weight is a
bucket alone."""


@dataclass(frozen=True)
class ReduceGroup:
    """Where a weight's gradient is averaged: summed over `group`, divided by `divisor`."""
    group: object
    divisor: int


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    where: ReduceGroup
    size_bytes: int
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    stale: bool = False


@dataclass
class _Step:
    counts: dict[int, int] = field(default_factory=dict)
    next_bucket: int = 0


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


class OverlappedReduction:
    """Bucketed asynchronous all-reduce of gradients as they complete (see the module doc).

    `begin_step()` before the step's first forward, `finish()` after its last backward: it waits
    for the buckets and returns the weights it averaged; the caller reduces the others."""

    def __init__(self, where: dict[int, tuple[nn.Parameter, ReduceGroup]],
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self._where = where
        self._bucket_bytes = bucket_bytes
        self._expected: dict[int, int] | None = None  # None until the first step has counted
        self._order: dict[int, None] = {}  # weights by their last accumulation, oldest first
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._step: _Step | None = None
        self.num_overlapped = 0
        """Buckets issued during backward so far (for tests and the runtime's report)."""
        for param, _ in where.values():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.on_accumulated)

    def begin_step(self) -> None:
        self._step = _Step()
        for bucket in self._buckets:
            bucket.ready, bucket.flat, bucket.work, bucket.stale = 0, None, None, False

    def on_accumulated(self, param: torch.Tensor) -> None:
        step, key = self._step, id(param)
        if step is None or key not in self._where:
            return
        count = step.counts[key] = step.counts.get(key, 0) + 1
        if self._expected is None:
            self._order.pop(key, None)
            self._order[key] = None
            return
        index = self._bucket_of.get(key)
        if index is None:
            return
        bucket = self._buckets[index]
        if count == self._expected[key]:
            bucket.ready += 1
            self._issue_ready(step)
        elif count > self._expected[key] and bucket.work is not None:
            bucket.stale = True

    def finish(self) -> set[int]:
        """Waits for (or issues, in order) every bucket; returns the ids of the weights averaged."""
        step, self._step = self._step, None
        if step is None:
            return set()
        if self._expected is None:  # the counting step: the caller reduces everything
            self._expected = dict(step.counts)
            self._buckets = self._make_buckets()
            self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
            return set()
        for bucket in self._buckets[step.next_bucket:]:
            self._issue(bucket)
        done: set[int] = set()
        for bucket in self._buckets:
            bucket.work.wait()
            if bucket.stale:
                self._issue(bucket)
                bucket.work.wait()
            self._write_back(bucket)
            done.update(id(param) for param in bucket.params)
        return done

    def _issue_ready(self, step: _Step) -> None:
        while step.next_bucket < len(self._buckets):
            bucket = self._buckets[step.next_bucket]
            if bucket.ready < len(bucket.params):
                return
            self._issue(bucket)
            self.num_overlapped += 1
            step.next_bucket += 1

    @torch.no_grad()
    def _issue(self, bucket: _Bucket) -> None:
        bucket.flat = torch.cat([(_local(param.grad) if param.grad is not None else torch.zeros_like(_local(param)))
                                 .reshape(-1) for param in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.where.group, async_op=True)

    @torch.no_grad()
    def _write_back(self, bucket: _Bucket) -> None:
        bucket.flat.div_(bucket.where.divisor)
        offset = 0
        for param in bucket.params:
            local_param = _local(param)
            numel = local_param.numel()
            value = bucket.flat[offset:offset + numel].view(local_param.shape)
            offset += numel
            if param.grad is None:
                param.grad = _zeros_like_grad(param)
            _local(param.grad).copy_(value)
        bucket.flat, bucket.work = None, None

    def _make_buckets(self) -> list[_Bucket]:
        """Consecutive weights in completion order, one group and dtype each, up to the byte cap."""
        buckets: list[_Bucket] = []
        for key in self._order:
            param, where = self._where[key]
            size = _local(param).numel() * param.element_size()
            last = buckets[-1] if buckets else None
            if last is None or last.where != where or last.params[0].dtype != param.dtype \
                    or last.size_bytes + size > self._bucket_bytes:
                buckets.append(_Bucket([param], where, size))
            else:
                last.params.append(param)
                last.size_bytes += size
        return buckets


def _zeros_like_grad(param: nn.Parameter) -> torch.Tensor:
    """A zero gradient laid out as the parameter (a DTensor's with its placements)."""
    return torch.zeros_like(param.detach())

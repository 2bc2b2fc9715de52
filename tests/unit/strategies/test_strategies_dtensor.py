"""DTensor consistency of every strategy the op families offer.

For representative nodes (shaped like the ones captured from GPT-2, Llama, BERT, ViT and the
built-in models, with sizes divisible by 4), every strategy offered on an axis of 4 devices is
run with DTensor: inputs in exactly the claimed placements, the aten op called as codegen would
call it. It must run with exactly the collectives its rule declares (none, but for the
vocabulary-parallel cross-entropy, which runs under DTensor's loss_parallel as codegen runs it),
produce the claimed output placement, and give the value one device computes. All ranks run in this one process: a fake process group provides the
mesh and `LocalTensorMode` holds one local tensor per rank, so the values are checked for real.

Every pointwise target gets a generated case; every other registered target needs a case or a
place in NOT_YET_CHECKED, which may only shrink (`test_every_rule_is_checked_in_dtensor`).

sdpa runs on the math backend: CPU's default flash kernel has no DTensor strategy (see
autopar/strategies/attention.py). A claimed "P" must be DTensor's Partial("sum") (or its masked
subclass, for the vocab-parallel embedding), or Partial("avg") for the mean-reducing ops listed
in AVERAGED.
"""

from __future__ import annotations

import operator
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import _random as dtensor_random
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import _REGISTRY, Strategy1D, has_rule, strategies_1d
from autopar.strategies.loss import VOCAB

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
WORLD_SIZE = 4
AVERAGED = {"aten.mean.dim", "aten.mean.default", "aten.cross_entropy_loss.default", "aten.nll_loss_nd.default",
            "aten.mse_loss.default"}
"""Ops whose "P" DTensor realises as Partial("avg") (reduction="mean")."""
RANDOM = {"aten.dropout.default", "aten.native_dropout.default"}
"""Ops whose values differ from one device's run (a different random mask)."""


@dataclass(frozen=True)
class Spec:
    """One tensor input: shape, dtype, and for integer inputs the exclusive upper bound."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int = 4


@dataclass(frozen=True)
class Case:
    target: str
    args: tuple
    inputs: tuple[Spec, ...]
    kwargs: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        shapes = "_".join("x".join(map(str, spec.shape)) for spec in self.inputs)
        return f"{self.target.removeprefix('aten.')}[{shapes}]"


def f32(*shape: int) -> Spec:
    return Spec(shape)


def i64(*shape: int, high: int = 4) -> Spec:
    return Spec(shape, torch.int64, high)


def boolean(*shape: int) -> Spec:
    return Spec(shape, torch.bool)


R0, R1, R2, R3, R4 = (Ref(index=k) for k in range(5))
MAX = 9223372036854775807

POINTWISE = [
    Case("aten.gelu.default", (R0,), (f32(4, 8, 16),)),
    Case("aten.add.Tensor", (R0, R1), (f32(4, 8, 16), f32(16))),
    Case("aten.add.Tensor", (R0, R1), (f32(4, 8, 16), f32(4, 8, 16))),
    Case("aten.mul.Tensor", (R0, R1), (f32(4, 8, 16), f32(4, 8, 1))),
    Case("aten.mul.Tensor", (R0, 0.25), (f32(4, 4, 8, 8),)),
    Case("aten.div.Tensor", (R0, R1), (f32(4, 8, 16), f32(4, 8, 1))),
    Case("aten.neg.default", (R0,), (f32(4, 4, 8, 8),)),
    Case("aten.to.dtype", (R0, "torch.float64"), (f32(4, 8, 16),)),
    Case("aten._to_copy.default", (R0,), (f32(4, 8),), {"dtype": "torch.float64"}),
    Case("aten.to.dtype", (R0, "torch.float32"), (boolean(4, 1, 8, 8),)),
    Case("aten.type_as.default", (R0, R1), (f32(4, 8, 16), Spec((4, 8, 16), torch.float64))),
    Case("aten.masked_fill.Scalar", (R0, R1, -1e9), (f32(4, 4, 8, 8), boolean(8, 8))),
    Case("aten.where.self", (R0, R1, R2), (boolean(4, 1, 8, 8), f32(4, 4, 8, 8), f32())),
    Case("aten.eq.Tensor", (R0, R1), (i64(4, 1, 8, 8), i64(8))),
    Case("aten.dropout.default", (R0, 0.1, True), (f32(4, 8, 16),)),
    Case("aten.zeros_like.default", (R0,), (f32(4, 8),)),
    Case("aten.new_ones.default", (R0, [2]), (f32(4, 8),), {"dtype": "torch.bool"}),
]
VIEWS = [
    Case("aten.view.default", (R0, [4, 8, 4, 4]), (f32(4, 8, 16),)),
    Case("aten.view.default", (R0, [4, 12]), (f32(8, 6),)),
    Case("aten.reshape.default", (R0, [4, 8, -1]), (f32(4, 8, 4, 4),)),
    Case("aten.flatten.using_ints", (R0, -2), (f32(4, 8, 4, 4),)),
    Case("aten.unflatten.int", (R0, -1, [4, 4]), (f32(4, 8, 16),)),
    Case("aten.transpose.int", (R0, 1, 2), (f32(4, 8, 4, 4),)),
    Case("aten.permute.default", (R0, [0, 2, 1, 3]), (f32(4, 8, 4, 4),)),
    Case("aten.unsqueeze.default", (R0, 1), (f32(4, 8),)),
    Case("aten.squeeze.dim", (R0, 1), (f32(4, 1, 8),)),
    Case("aten.expand.default", (R0, [4, 4, 8, 8]), (f32(4, 1, 8, 8),)),
    Case("aten.expand.default", (R0, [4, -1]), (i64(1, 16),)),
    Case("aten.split.Tensor", (R0, 16, 2), (f32(4, 8, 48),)),
    Case("aten.chunk.default", (R0, 2, -1), (f32(4, 4, 8, 8),)),
    Case("aten.unbind.int", (R0, 0), (f32(3, 4, 8),)),
    Case("aten.slice.Tensor", (R0, 0, 0, MAX), (i64(4, 16),)),
    Case("aten.slice.Tensor", (R0, 3, 0, 4), (f32(4, 4, 8, 8),)),
    Case("aten.select.int", (R0, 1, 0), (f32(4, 8, 16),)),
    Case("aten.cat.default", ([R0, R1], -1), (f32(4, 4, 8, 4), f32(4, 4, 8, 4))),
    Case("aten.stack.default", ([R0, R1], 1), (f32(4, 8), f32(4, 8))),
    Case("aten.repeat_interleave.self_int", (R0, 2, 1), (f32(4, 4, 8, 8),)),
    Case("aten.repeat.default", (R0, [1, 2, 1]), (f32(4, 8, 4),)),
    Case("aten.expand_as.default", (R0, R1), (f32(4, 1), f32(4, 8))),
    Case("aten.gather.default", (R0, 1, R1), (f32(4, 8), i64(4, 8, high=8))),
    Case("aten.broadcast_tensors.default", ([R0, R1],), (f32(4, 8), f32(8))),
]
REDUCTIONS = [
    Case("aten.sum.dim_IntList", (R0, [-1], True), (f32(4, 8, 16),)),
    Case("aten.sum.default", (R0,), (f32(4, 8),)),
    Case("aten.mean.dim", (R0, [-1], True), (f32(4, 8, 16),)),
    Case("aten.mean.dim", (R0, [1]), (f32(4, 8, 16),)),
    Case("aten.max.dim", (R0, 1), (f32(4, 8, 16),)),
    Case("aten.var.correction", (R0, [-1]), (f32(4, 8),), {"correction": 0, "keepdim": True}),
    Case("aten.softmax.int", (R0, -1), (f32(4, 4, 8, 8),)),
    Case("aten.cumsum.default", (R0, -1), (i64(4, 16),)),
    Case("aten.topk.default", (R0, 2), (f32(4, 8, 8),)),
]
NORMS = [
    Case("aten.layer_norm.default", (R0, [16], R1, R2, 1e-5, False), (f32(4, 8, 16), f32(16), f32(16))),
    Case("aten.rms_norm.default", (R0, [16], R1, 1e-6), (f32(4, 8, 16), f32(16))),
    Case("aten.group_norm.default", (R0, 2, R1, R2), (f32(4, 8, 4, 4), f32(8), f32(8))),
    Case("aten.batch_norm.default", (R0, R1, R2, R3, R4, True, 0.1, 1e-5, False),
         (f32(4, 8, 4, 4), f32(8), f32(8), f32(8), f32(8))),
]
EMBEDDINGS = [Case("aten.embedding.default", (R0, R1), (f32(16, 8), i64(4, 8, high=16)))]
ATTENTION = [
    Case("aten.scaled_dot_product_attention.default", (R0, R1, R2, R3),
         (f32(4, 4, 8, 8), f32(4, 4, 8, 8), f32(4, 4, 8, 8), boolean(4, 1, 8, 8))),
    Case("aten.scaled_dot_product_attention.default", (R0, R1, R2), (f32(4, 8, 8, 8), f32(4, 4, 8, 8), f32(4, 4, 8, 8)),
         {"enable_gqa": True}),
]
CONVS = [
    Case("aten.conv2d.default", (R0, R1, R2, [2, 2]), (f32(4, 3, 8, 8), f32(8, 3, 2, 2), f32(8))),
    Case("aten.max_pool2d.default", (R0, [2, 2]), (f32(4, 8, 8, 8),)),
]
LOSSES = [
    Case("aten.cross_entropy_loss.default", (R0, R1), (f32(8, 16), i64(8, high=16))),
    Case("aten.cross_entropy_loss.default", (R0, R1), (f32(4, 16, 8), i64(4, 8, high=16))),
    Case("aten.cross_entropy_loss.default", (R0, R1, None, 0), (f32(8, 16), i64(8, high=16))),
    Case("aten.nll_loss_nd.default", (R0, R1, None, 2), (f32(8, 16), i64(8, high=16))),
    Case("aten.mse_loss.default", (R0, R1), (f32(4, 8), f32(4, 8))),
]


def _generated_pointwise() -> list[Case]:
    """A case for every pointwise target of pointwise.py: the first of a few argument patterns
    (float, scalar, integer and boolean operands, broadcast along the last dim) that the op accepts."""
    from autopar.strategies.pointwise import NONLINEAR_NARY, NONLINEAR_UNARY

    unary = [((R0,), (f32(4, 8, 16),)), ((R0, 0.5), (f32(4, 8, 16),)), ((R0, -0.5, 0.5), (f32(4, 8, 16),)),
             ((R0, 0.1, True), (f32(4, 8, 16),)), ((2.0, R0), (f32(4, 8, 16),)), ((R0, 3), (i64(4, 8, 16),)),
             ((R0,), (i64(4, 8, 16),))]
    nary = [((R0, R1), (f32(4, 8, 16), f32(16))), ((R0, R1), (i64(4, 8, 16), i64(16))),
            ((R0, R1), (boolean(4, 8, 16), boolean(16))), ((R0, R1, -1.0), (f32(4, 8, 16), boolean(8, 16))),
            ((R0, R1, R2), (boolean(4, 8, 16), f32(4, 8, 16), f32(16))), ((R0, R1, 0.5), (boolean(4, 8, 16), f32(16))),
            ((R0, 0.5, R1), (boolean(4, 8, 16), f32(16))), ((R0, R1, R2), (f32(4, 8, 16), f32(16), f32(8, 1))),
            ((R0, R1, 0.5), (f32(4, 8, 16), f32(16))), ((R0, R1, 0.3), (f32(4, 8, 16), f32(16)))]
    tested = {case.target for case in POINTWISE}
    cases = []
    for target in NONLINEAR_UNARY + NONLINEAR_NARY:
        for args, specs in (unary if target in NONLINEAR_UNARY else nary):
            case = Case(target, args, specs)
            if target not in tested and _runs(case):
                cases.append(case)
                break
    return cases


def _runs(case: Case) -> bool:
    try:
        _call(case, [_random(spec) for spec in case.inputs])
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


MATMULS = [
    Case("aten.linear.default", (R0, R1, R2), (f32(4, 8, 16), f32(32, 16), f32(32))),
    Case("aten.linear.default", (R0, R1), (f32(4, 8, 16), f32(32, 16))),
    Case("aten.matmul.default", (R0, R1), (f32(4, 4, 8, 8), f32(4, 4, 8, 8))),
    Case("aten.mm.default", (R0, R1), (f32(8, 16), f32(16, 32))),
    Case("aten.bmm.default", (R0, R1), (f32(4, 8, 16), f32(4, 16, 8))),
]
CASES = MATMULS + POINTWISE + VIEWS + REDUCTIONS + NORMS + EMBEDDINGS + ATTENTION + CONVS + LOSSES


@pytest.fixture(scope="module")
def mesh():
    """A 4-device CPU mesh on a fake process group (made here unless a group already exists)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    yield DeviceMesh("cpu", list(range(WORLD_SIZE)))
    dtensor_random._rng_tracker = None  # dropout under LocalTensorMode installed a simulated one
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_every_offered_strategy_runs_in_dtensor_with_its_declared_collectives(case: Case, mesh) -> None:
    torch.manual_seed(0)
    tensors = [_random(spec) for spec in case.inputs]
    expected = _as_list(_call(case, tensors))
    node = _node(case, tensors, expected)
    offered = [s for s in strategies_1d(node, _metas(tensors), WORLD_SIZE) if s.name != "replicate"]
    assert offered, f"{case.id}: no strategy besides replicate"
    failures = [f"{strategy}: {problem}" for strategy in offered
                if (problem := _check(case, strategy, tensors, expected, mesh))]
    assert not failures, "\n".join(failures)


def _check(case: Case, strategy: Strategy1D, tensors: list, expected: list, mesh) -> str:
    """Why DTensor disagrees with the strategy ("" when it agrees)."""
    with LocalTensorMode(frozenset(range(WORLD_SIZE))):
        inputs = [_distribute(tensor, placement, mesh) for tensor, placement in zip(tensors, strategy.inputs)]
        with CommDebugMode() as comms, sdpa_kernel(SDPBackend.MATH), \
                (loss_parallel() if strategy.name == VOCAB else nullcontext()):
            outputs = _as_list(_call(case, inputs))
        ran = Counter({str(op).split(".")[-1].removesuffix("_"): count for op, count in comms.get_comm_counts().items()})
        declared = Counter(op for op, _, _ in strategy.collectives)
        if +ran != declared:
            return f"collectives {dict(comms.get_comm_counts())}, declared {dict(declared)}"
        placements = [output.placements[0] for output in outputs]
        if not all(_matches(placement, strategy.output, case.target) for placement in placements):
            return f"output placements {placements}"
        values = [_gathered(output, strategy.output) for output in outputs]
    if case.target in RANDOM:
        return ""
    for got, want in zip(values, expected):
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5, equal_nan=True):
            return "wrong value"
    return ""


def _gathered(output: DTensor, placement: str) -> torch.Tensor:
    """The global value of a DTensor, assembled from the ranks' pieces (cheaper than full_tensor,
    which simulates the collectives; a Partial goes through it because DTensor's masked partial
    only becomes a true sum in its reduction)."""
    if placement == "P":
        return output.full_tensor()._local_tensors[0]
    pieces = [output.to_local()._local_tensors[rank] for rank in range(WORLD_SIZE)]
    if placement == "R":
        assert all(torch.equal(piece, pieces[0]) for piece in pieces), "replicas differ"
        return pieces[0]
    return torch.cat(pieces, dim=int(placement[1:]))


def _matches(placement, claimed: str, target: str) -> bool:
    if claimed == "R":
        return isinstance(placement, Replicate)
    if claimed == "P":
        allowed = ("sum", "avg") if target in AVERAGED else ("sum",)
        return isinstance(placement, Partial) and placement.reduce_op in allowed
    return isinstance(placement, Shard) and placement.dim == int(claimed[1:])


def _distribute(tensor: torch.Tensor, placement: str, mesh) -> DTensor:
    """A DTensor in `placement` whose per-rank pieces are built by hand (Partial: uneven pieces)."""
    if placement == "R":
        pieces = [tensor.clone() for _ in range(WORLD_SIZE)]
    elif placement == "P" and tensor.is_floating_point():
        offset = torch.randn_like(tensor)
        pieces = [tensor * 0.7 + offset] + [(tensor * 0.3 - offset) / (WORLD_SIZE - 1) for _ in range(WORLD_SIZE - 1)]
    elif placement == "P":
        offset = torch.randint_like(tensor, -5, 5)
        pieces = [tensor - (WORLD_SIZE - 1) * offset] + [offset] * (WORLD_SIZE - 1)
    else:
        pieces = [piece.contiguous() for piece in tensor.chunk(WORLD_SIZE, int(placement[1:]))]
    dtensor_placement = {"R": Replicate(), "P": Partial()}.get(placement) or Shard(int(placement[1:]))
    local = LocalTensor(dict(enumerate(pieces)))
    return DTensor.from_local(local, mesh, [dtensor_placement], run_check=False, shape=tensor.shape,
                              stride=tensor.stride())


def _random(spec: Spec) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=spec.dtype)
    if spec.dtype == torch.bool:
        return torch.rand(spec.shape) > 0.5
    return torch.randint(0, spec.high, spec.shape, dtype=spec.dtype)


def _call(case: Case, tensors: list):
    """Run the aten op with the Refs of the captured call replaced by `tensors`."""
    def fill(value):
        if isinstance(value, Ref):
            return tensors[value.index]
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        if isinstance(value, str) and value.startswith("torch."):
            return getattr(torch, value.removeprefix("torch."))
        return value

    _, name, overload = case.target.split(".")
    op = getattr(getattr(torch.ops.aten, name), overload)
    return op(*fill(case.args), **{key: fill(value) for key, value in case.kwargs.items()})


def _as_list(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _metas(tensors: list) -> list[TensorMeta]:
    return [TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors]


def _node(case: Case, tensors: list, outputs: list) -> OpNode:
    return OpNode(name="node", kind="call", target=case.target, inputs=tuple(f"in{k}" for k in range(len(tensors))),
                  args=case.args, kwargs=tuple(case.kwargs.items()), outputs=tuple(_metas(outputs)))


def test_getitem_keeps_the_producers_placement() -> None:
    """getitem is Python's operator, not an aten op: the split's outputs are what it returns."""
    split = Case("aten.split.Tensor", (R0, 16, 2), (f32(4, 8, 48),))
    outputs = _as_list(_call(split, [torch.randn(4, 8, 48)]))
    selected = operator.getitem(outputs, 1)
    node = OpNode(name="getitem", kind="call", target="getitem", inputs=("split",), args=(R0, 1),
                  outputs=tuple(_metas([selected])))
    found = {(s.inputs, s.output) for s in strategies_1d(node, _metas(outputs[:1]), WORLD_SIZE)}
    assert {(("S0",), "S0"), (("S1",), "S1"), (("P",), "P")} <= found


# transformers' grouped expert matmul, a custom op, under the two names a graph may give it.
GROUPED_MM_CUSTOM_OPS = ("grouped_mm_fallback.default", "transformers.grouped_mm_fallback.default",
                         "grouped_mm.default", "autopar.grouped_mm.default")
LOCAL_RULES = ("expert_bias.default", "autopar.expert_bias.default")
"""Custom ops DTensor cannot run: the runtime runs them on local shards (codegen/local_ops.py) and
test_strategies_grouped_mm.py checks their rules on column shards."""


def test_every_registered_target_is_an_aten_overload() -> None:
    has_rule("getitem")  # loads the families
    unknown = []
    for target in _REGISTRY:
        if target == "getitem" or target in GROUPED_MM_CUSTOM_OPS + LOCAL_RULES:
            continue
        _, name, overload = target.split(".")
        if not hasattr(getattr(torch.ops.aten, name, None), overload):
            unknown.append(target)
    assert not unknown


GENERATED = _generated_pointwise()


@pytest.mark.parametrize("case", GENERATED, ids=[case.id for case in GENERATED])
def test_every_pointwise_target_runs_in_dtensor_as_its_rule_says(case: Case, mesh) -> None:
    test_every_offered_strategy_runs_in_dtensor_with_its_declared_collectives(case, mesh)


NOT_YET_CHECKED = frozenset({
    "aten._fused_rms_norm.default", "aten._grouped_mm.default", "aten._log_softmax.default",
    "aten._safe_softmax.default", "aten._softmax.default", "aten._unsafe_view.default",
    "aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool3d.default",
    "aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default", "aten.addmm.default",
    "aten.alias.default", "aten.all.dim", "aten.amax.default", "aten.amin.default", "aten.any.dim", "aten.any.dims",
    "aten.argmax.default", "aten.argmin.default", "aten.argsort.default", "aten.argsort.stable",
    "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default", "aten.baddbmm.default",
    "aten.binary_cross_entropy.default", "aten.binary_cross_entropy_with_logits.default",
    "aten.broadcast_to.default", "aten.concat.default", "aten.concatenate.default", "aten.contiguous.default",
    "aten.conv1d.default", "aten.conv3d.default", "aten.conv_transpose1d.default", "aten.conv_transpose2d.input",
    "aten.conv_transpose3d.input", "aten.convolution.default", "aten.cummax.default", "aten.cummin.default",
    "aten.cumprod.default", "aten.detach.default", "aten.div.Scalar", "aten.einsum.default",
    "aten.empty_like.default", "aten.full_like.default", "aten.huber_loss.default", "aten.kl_div.default",
    "aten.l1_loss.default", "aten.lift_fresh_copy.default", "aten.linalg_vector_norm.default",
    "aten.log_softmax.int", "aten.logcumsumexp.default", "aten.logsumexp.default", "aten.masked_fill.Tensor",
    "aten.max_pool1d.default", "aten.max_pool3d.default", "aten.mean.default", "aten.min.dim", "aten.movedim.int",
    "aten.mul.Scalar", "aten.nansum.default", "aten.narrow.default", "aten.native_group_norm.default",
    "aten.native_layer_norm.default", "aten.new_empty.default", "aten.new_full.default", "aten.new_zeros.default",
    "aten.nll_loss.default", "aten.nll_loss2d.default", "aten.norm.ScalarOpt_dim", "aten.numpy_T.default",
    "aten.ones_like.default", "aten.prod.dim_int", "aten.rand_like.default", "aten.randn_like.default",
    "aten.reshape_as.default", "aten.smooth_l1_loss.default", "aten.soft_margin_loss.default", "aten.sort.default",
    "aten.sort.stable", "aten.split_with_sizes.default", "aten.squeeze.default", "aten.squeeze.dims",
    "aten.std.correction", "aten.std.dim", "aten.sub.Tensor", "aten.swapaxes.default", "aten.t.default",
    "aten.tensor_split.sections", "aten.to.device", "aten.to.dtype_layout", "aten.var.dim",
    "aten.var_mean.correction", "aten.view_as.default", "aten.view_copy.default", "aten.where.Scalar",
    "grouped_mm_fallback.default", "transformers.grouped_mm_fallback.default", "grouped_mm.default",
    "autopar.grouped_mm.default"
})
"""Registered targets that no case above runs in DTensor yet (siblings of checked targets that
share their generator). The list may only shrink: a new rule comes with its case."""


def test_every_rule_is_checked_in_dtensor() -> None:
    """A rule the ILP may choose must be one DTensor proves exact on real values: a registered
    target with no case here (and not in NOT_YET_CHECKED) fails, as does an in-place target."""
    from autopar.graph import OpNode
    from autopar.strategies.aliasing import writes_in_place

    has_rule("getitem")  # loads the families
    checked = {case.target for case in CASES + GENERATED} | {"getitem"} | set(LOCAL_RULES)
    unchecked = sorted(set(_REGISTRY) - checked - NOT_YET_CHECKED)
    assert not unchecked, f"rules no DTensor case checks: add a Case for each of {unchecked}"
    assert not sorted(NOT_YET_CHECKED & checked), "checked now: remove these from NOT_YET_CHECKED"
    in_place = [target for target in _REGISTRY if writes_in_place(OpNode(name="n", kind="call", target=target))]
    assert not in_place, f"in-place ops must stay unsharded (strategies/aliasing.py): {in_place}"

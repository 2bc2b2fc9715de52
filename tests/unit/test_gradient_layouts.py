"""Backward kernels probed with the gradient layout autograd hands each op (autopar/gradient_layouts.py)."""

from collections import Counter

import torch

from autopar.capture import capture
from autopar.models import build_model
from autopar.probe import KernelRecorder

_SEED = "aten.ones_like.default"  # backward's seed gradient, made by the caller, not a kernel of the model


def _backward_kernels(spec: str) -> tuple[Counter, Counter]:
    """(captured, run) kernel names of one backward: the capture's, and real autograd's on CPU."""
    bundle = build_model(spec, batch_size=2, device="cpu", seed=0)
    model = bundle.model.eval()
    graph = capture(model, bundle.example_inputs, dynamic_batch=False)
    out = model(*bundle.example_inputs)
    with KernelRecorder() as recorder:
        out.backward(torch.ones_like(out))
    run = Counter(kernel.name for kernel in recorder.kernels if kernel.name != _SEED)
    captured = Counter(kernel.name for node in graph.calls() for kernel in node.bwd_kernels)
    return captured, run


def test_an_eager_attention_backward_is_captured_kernel_for_kernel():
    """q, k and v are transposed views of the projections' outputs and the context a transposed
    view of the attention's: their gradients arrive laid out for the matmuls, and four reshapes
    per layer copy them back (the copies only the backward makes), besides autograd's sums."""
    captured, run = _backward_kernels("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,dropout=0")
    assert run["aten.clone.default"] == 8
    assert captured == run


def test_fused_attention_adds_no_copies():
    captured, run = _backward_kernels("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,dropout=0,attention=sdpa")
    assert captured["aten.clone.default"] == run["aten.clone.default"] == 0
    assert captured["aten.add.Tensor"] == run["aten.add.Tensor"]

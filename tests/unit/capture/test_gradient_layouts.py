"""Backward kernels probed with the gradient layout autograd hands each op (autopar/capture/gradient_layouts.py)."""

from collections import Counter

import pytest
import torch

from autopar.capture.export import capture
from autopar.models import build_model
from autopar.capture.probe import KernelRecorder

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


def _hf_model(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, attn_implementation="eager",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=32, attn_implementation="eager"))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_eager_models_backward_is_captured_kernel_for_kernel(name):
    """Hugging Face's own attention and norms, as users have them: every kernel real autograd
    runs in the backward (sums of gradients and copies included) is in the capture, but for
    empty allocations (zero elements)."""
    torch.manual_seed(0)
    model = _hf_model(name).eval()
    tokens, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    graph = capture(model, (tokens,), loss_fn=loss_fn, example_targets=targets, dynamic_batch=False)
    loss = loss_fn(model(tokens), targets)
    with KernelRecorder() as recorder:
        loss.backward()
    run = Counter(kernel.name for kernel in recorder.kernels if kernel.name != _SEED and kernel.io_bytes > 0)
    captured = Counter(kernel.name for node in graph.calls() for kernel in node.bwd_kernels)
    assert captured == run

"""capture/compute_dtype.py: the program codegen runs is traced in the dtypes the runtime computes
in; replica.py's buffer-keeping replica; graph.py's fingerprint across the dtype a model was
traced in."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from autopar.capture.compute_dtype import capture_for_codegen, traced_in_compute_dtype
from autopar.capture.export import capture_program
from autopar.capture.replica import compute_replica


def hf_llama() -> torch.nn.Module:
    """A tiny Hugging Face Llama in fp32, as from_config builds it (its RMSNorm casts back to the
    dtype it read while running)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def linear_input_dtypes(graph) -> set[str]:
    """The dtypes of what every linear of `graph` multiplies (its activation input)."""
    return {graph[node.inputs[0]].output.dtype for node in graph.calls() if node.target == "aten.linear.default"}


def test_an_fp32_model_is_traced_as_its_bf16_compute_runs_it():
    model = hf_llama()
    _, as_given = capture_program(model, (TOKENS,), allow_fallback=False)
    assert linear_input_dtypes(as_given) == {"float32"}  # RMSNorm's .to(input_dtype) read fp32
    program, traced = capture_for_codegen(model, (TOKENS,), precision="bf16")
    assert linear_input_dtypes(traced) == {"bfloat16"}
    own = dict(model.named_parameters())
    assert all(program.state_dict[name] is own[name] for name in own)  # bound by name: the model's, not fakes
    _, for_fp8 = capture_for_codegen(model, (TOKENS,), precision="fp8")
    assert linear_input_dtypes(for_fp8) == {"bfloat16"}
    assert all(param.dtype == torch.float32 and not param.is_meta for param in model.parameters())  # untouched


def test_fp32_compute_or_a_bf16_model_is_traced_as_given():
    model = hf_llama()
    assert not traced_in_compute_dtype(model, "fp32")
    assert traced_in_compute_dtype(model, "bf16") and traced_in_compute_dtype(model, "fp8")
    bf16_model = model.to(torch.bfloat16)
    assert not traced_in_compute_dtype(bf16_model, "bf16")
    _, traced = capture_for_codegen(bf16_model, (TOKENS,), precision="bf16")
    assert linear_input_dtypes(traced) == {"bfloat16"}


def test_the_codegen_replica_is_fake_on_the_models_device_with_its_buffers_dtypes():
    model = hf_llama()
    replica, inputs, keywords = compute_replica(model, torch.bfloat16, (TOKENS,), {"labels": TOKENS.float()})
    assert {param.dtype for param in replica.parameters()} == {torch.bfloat16}
    assert all(isinstance(tensor, FakeTensor) and tensor.device == torch.device("cpu")
               for tensor in [*replica.parameters(), *replica.buffers(), *inputs, *keywords.values()])
    assert {name: buffer.dtype for name, buffer in replica.named_buffers()} == \
        {name: buffer.dtype for name, buffer in model.named_buffers()}
    assert inputs[0].dtype == torch.int64 and keywords["labels"].dtype == torch.bfloat16
    assert replica.lm_head.weight is replica.model.embed_tokens.weight or \
        model.lm_head.weight is not model.model.embed_tokens.weight  # ties stay ties
    assert all(param.dtype == torch.float32 and not isinstance(param, FakeTensor) for param in model.parameters())


def test_one_fingerprint_whatever_dtype_the_model_was_traced_in():
    """A cast to the dtype a tensor has returns that tensor: which node a later reader names
    depends on the dtype the model was traced in. The plan (a bf16 replica) is recognised on the
    model traced in fp32, in bf16, and as codegen traces it."""
    from autopar.api import capture_for_planning

    model = hf_llama()
    planned = capture_for_planning(model, (TOKENS,), precision="bf16", cache=False)
    _, as_given = capture_program(model, (TOKENS,), allow_fallback=False)
    _, for_codegen = capture_for_codegen(model, (TOKENS,), precision="bf16")
    assert planned.fingerprint() == as_given.fingerprint() == for_codegen.fingerprint()
    wider = hf_llama().to(torch.bfloat16)
    wider.lm_head = torch.nn.Linear(64, 256, bias=False)
    assert capture_program(wider, (TOKENS,), allow_fallback=False)[1].fingerprint() != planned.fingerprint()

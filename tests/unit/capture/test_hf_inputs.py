"""Hugging Face models as users call them: keyword inputs, a loss on the ModelOutput, no targets."""

import pytest
import torch

import autopar
from autopar.api import capture_for_planning, split_inputs

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_a_dict_of_inputs_is_keyword_inputs() -> None:
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert split_inputs(dict(input_ids=tokens)) == ((), {"input_ids": tokens})
    assert split_inputs((tokens,), {"attention_mask": tokens}) == ((tokens,), {"attention_mask": tokens})
    assert split_inputs(tokens) == ((tokens,), {})


def test_loss_without_targets_is_priced_on_the_traced_output_shape() -> None:
    # transformers' mask code calls .item()-like checks that fail when the model runs on meta:
    # the targets' shape comes from the traced graph instead.
    model = _tiny_llama()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    seen = []

    def loss_fn(output, targets):
        seen.append(type(output).__name__)
        return ((output.logits.float() - targets) ** 2).mean()

    graph = capture_for_planning(model, dict(input_ids=tokens), loss_fn=loss_fn, precision="fp32")
    assert graph.loss_nodes and seen == ["CausalLMOutputWithPast"]
    plan = autopar.plan(graph, cluster="cpu:procs=2", global_batch=2, constraints={"dp": 1, "tp": 2, "pp": 1})
    assert plan.mesh["tp"] == 2


def test_a_default_config_with_its_kv_cache_trains(one_process_group) -> None:
    """transformers' configs default to use_cache=True: the model then returns a DynamicCache,
    which torch.export cannot return. Training reads no cache, so the capture runs without it;
    the user's config is left as it was, and the gradients are eager PyTorch's."""
    import copy

    import torch.nn.functional as F

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    assert config.use_cache is True
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tokens, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    reference = copy.deepcopy(model)
    expected = loss_fn(reference(input_ids=tokens), labels)
    expected.backward()
    pm = autopar.parallelize(model, "cpu:procs=1", dict(input_ids=tokens), loss_fn=loss_fn, example_targets=labels,
                             precision="fp32")
    loss = pm.train_step(dict(input_ids=tokens), labels)
    assert model.config.use_cache is True
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    grads = pm.named_model_parameters()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-6)
    # The SwiGLU of each layer kept its activation as a recipe (activation_saves.py).
    assert pm.stats.kept["recomputed_activation"] == 2


def test_every_config_of_the_model_is_captured_without_its_cache() -> None:
    """T5's decoder stack holds a config of its own (a copy): the cache is off on every config
    while the model is traced (its output then holds no EncoderDecoderCache), and back on after."""
    from autopar.capture.export import capture

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    configs = [module.config for module in model.modules() if hasattr(module, "config")]
    before = [c.use_cache for c in configs]
    assert sum(c.use_cache is True and c is not model.config for c in configs) >= 1  # the decoder's copy
    tokens = torch.zeros(2, 8, dtype=torch.long)
    graph = capture(model, (), dict(input_ids=tokens, decoder_input_ids=tokens))
    assert graph.nodes and [c.use_cache for c in configs] == before

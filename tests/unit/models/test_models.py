"""Built-in model families: build, forward, train, meta, export, shapes from the papers."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autopar.models import FAMILIES, NAMED_SIZES, batch_dynamic_shapes, build_model
from autopar.models.gpt import GPT, GPTConfig, parameter_count_formula
from conftest import reference_rows  # tests/conftest.py (pytest puts tests/ on sys.path)

FAMILY_NAMES = sorted(FAMILIES)



def expected_output_shape(bundle, batch_size):
    config = bundle.config
    if bundle.name.startswith("vit"):
        return (batch_size, config.num_classes)
    if bundle.name.startswith("mlp"):
        return (batch_size, config.out_features)
    return (batch_size, config.seq, config.vocab)


def num_parameters(model: nn.Module) -> int:
    return sum(param.numel() for param in model.parameters())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tiny_model_forward_and_loss(family):
    bundle = build_model(family, device="cpu", seed=0, batch_size=3)
    output = bundle.model(*bundle.example_inputs)
    assert output.shape == expected_output_shape(bundle, 3)
    loss = bundle.loss_fn(output, bundle.example_targets)
    assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sgd_steps_lower_the_loss(family):
    bundle = build_model(family, device="cpu", seed=0)
    optimizer = torch.optim.SGD(bundle.model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        loss = bundle.loss_fn(bundle.model(*bundle.example_inputs), bundle.example_targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_builds_on_meta_without_allocating(family):
    bundle = build_model(family)
    assert all(param.is_meta for param in bundle.model.parameters())
    assert all(value.is_meta for value in bundle.example_inputs)
    assert bundle.example_targets.is_meta
    output = bundle.model(*bundle.example_inputs)
    assert output.is_meta and output.shape == expected_output_shape(bundle, 2)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_blocks_live_in_a_module_list_named_layers(family):
    model = build_model(family).model
    assert isinstance(model.layers, nn.ModuleList)
    assert len(model.layers) == model.config.layers
    shapes = [[(name, param.shape) for name, param in block.named_parameters()] for block in model.layers]
    assert all(block_shapes == shapes[0] for block_shapes in shapes)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exports_with_a_dynamic_batch(family, device):
    bundle = build_model(family, device=device, seed=0)
    model = bundle.model.eval()
    exported = torch.export.export(
        model, bundle.example_inputs, dynamic_shapes=batch_dynamic_shapes(bundle.example_inputs), strict=False
    )
    bigger = build_model(family, device=device, seed=1, batch_size=5).example_inputs
    output = exported.module()(*bigger)
    assert output.shape == expected_output_shape(bundle, 5)
    if device == "cpu":
        torch.testing.assert_close(output, model(*bigger))


@pytest.mark.parametrize("spec", ["gpt:attention=sdpa", "vit:attention=sdpa", "moe:top_k=1", "moe:router=gshard,top_k=1"])
def test_variants_export_on_meta(spec):
    bundle = build_model(spec)
    dynamic_shapes = batch_dynamic_shapes(bundle.example_inputs)
    exported = torch.export.export(bundle.model, bundle.example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    (input_name,) = exported.graph_signature.user_inputs
    assert isinstance(placeholders[input_name].meta["val"].shape[0], torch.SymInt)  # batch stays symbolic


def test_seed_makes_builds_identical():
    first, second = (build_model("gpt", device="cpu", seed=7) for _ in range(2))
    other = build_model("gpt", device="cpu", seed=8)
    for name, param in first.model.state_dict().items():
        assert torch.equal(param, second.model.state_dict()[name])
    assert torch.equal(first.example_inputs[0], second.example_inputs[0])
    assert not torch.equal(first.model.wte.weight, other.model.wte.weight)


# --- GPT ----------------------------------------------------------------------------------------


def test_gpt_parameters_follow_megatron_formula():
    model = build_model("gpt", device="cpu").model
    final_norm = 2 * model.config.hidden
    assert num_parameters(model) - final_norm == parameter_count_formula(model.config)
    assert not any("head" in name for name, _ in model.named_parameters())  # output tied to wte


@settings(max_examples=20, deadline=None)
@given(
    layers=st.integers(1, 4),
    head_dim=st.integers(1, 16),
    heads=st.integers(1, 6),
    seq=st.integers(1, 64),
    vocab=st.integers(1, 300),
)
def test_gpt_formula_holds_for_any_shape(layers, head_dim, heads, seq, vocab):
    config = GPTConfig(layers=layers, hidden=head_dim * heads, heads=heads, seq=seq, vocab=vocab)
    with torch.device("meta"):
        model = GPT(config)
    assert num_parameters(model) - 2 * config.hidden == parameter_count_formula(config)


def test_gpt3_175b_builds_on_meta_without_allocating():
    bundle = build_model("gpt3-175b")
    assert all(tensor.is_meta for tensor in [*bundle.model.parameters(), *bundle.model.buffers()])
    hidden, layers = 12288, 96
    formula = 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (51200 + 2048) / (12 * layers * hidden))
    count = num_parameters(bundle.model) - 2 * hidden
    assert count == round(formula) == 174_615_822_336


def test_gpt_shapes_of_megatron_table1():
    for row in reference_rows("megatron_table1.csv"):
        spec = f"gpt:layers={row['layers']},hidden={row['hidden']},heads={row['heads']},seq=2048,vocab=51200"
        count = num_parameters(build_model(spec).model)
        assert count / 1e9 == pytest.approx(float(row["params_billion"]), rel=0.035), spec


def test_gpt_eager_and_sdpa_attention_agree():
    eager = build_model("gpt:dropout=0.0", device="cpu", seed=0)
    sdpa = build_model("gpt:dropout=0.0,attention=sdpa", device="cpu", seed=0)
    sdpa.model.load_state_dict(eager.model.state_dict())
    torch.testing.assert_close(eager.model(*eager.example_inputs), sdpa.model(*eager.example_inputs))


def test_gpt_is_causal_and_takes_shorter_sequences():
    model = build_model("gpt:dropout=0.0", device="cpu", seed=0).model
    tokens = torch.randint(0, 128, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 128
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])
    with pytest.raises(ValueError, match="built for seq=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", 8_030_261_248),  # Meta's Llama 3 8B
        ("bert-base", 109_514_298),  # Hugging Face BertForMaskedLM
        ("vit-b16", 86_567_656),  # timm vit_base_patch16_224
        ("vit-l16", 304_326_632),  # timm vit_large_patch16_224
    ],
)
def test_published_parameter_counts(name, expected):
    assert num_parameters(build_model(name).model) == expected


@pytest.mark.parametrize("name", sorted(NAMED_SIZES))
def test_named_sizes_build_on_meta(name):
    bundle = build_model(name)
    assert bundle.name == name
    assert len(bundle.model.layers) == bundle.config.layers


# --- LLaMA --------------------------------------------------------------------------------------


def test_llama_norms_agree_and_an_unknown_norm_is_refused():
    """The fused norm (F.rms_norm) and the float32 composite (norm=float32) compute the same
    thing; only how many kernels run and what they keep differ."""
    from autopar.errors import ModelSpecError

    fused, upcast = (build_model(spec, device="cpu", seed=0) for spec in ("llama", "llama:norm=float32"))
    assert not fused.model.layers[0].attn_norm.upcast and upcast.model.layers[0].attn_norm.upcast
    tokens = fused.example_inputs[0]
    torch.testing.assert_close(fused.model(tokens), upcast.model(tokens))
    with pytest.raises(ModelSpecError, match="norm='layer' is not one of fused, float32"):
        build_model("llama:norm=layer")


def test_llama_grouped_query_shapes_and_rotary_buffers():
    model = build_model("llama:hidden=64,heads=8,kv_heads=2").model
    attn = model.layers[0].attn
    assert attn.q_proj.weight.shape == (64, 64)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (16, 64)
    assert model.rotary.cos.shape == (32, 8)
    assert not any("cos" in name or "sin" in name for name in model.state_dict())  # non-persistent


def test_llama_init_weights_refills_rotary_buffers_after_to_empty():
    reference = build_model("llama", device="cpu", seed=0).model
    model = build_model("llama").model.to_empty(device="cpu")
    model.init_weights()
    torch.testing.assert_close(model.rotary.cos, reference.rotary.cos)
    torch.testing.assert_close(model.rotary.sin, reference.rotary.sin)
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


# --- Against Hugging Face implementations (numerics of rotary, GQA, post-LN, tied MLM head) --------


def test_llama_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    bundle = build_model("llama", device="cpu", seed=0)
    config = bundle.config
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.ffn_hidden,
            num_hidden_layers=config.layers, num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads, max_position_embeddings=config.seq,
            rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps, tie_word_embeddings=False,
        )
    ).eval()
    renames = {
        ".attn_norm.": ".input_layernorm.",
        ".mlp_norm.": ".post_attention_layernorm.",
        ".attn.": ".self_attn.",
    }
    state = {}
    for name, value in bundle.model.state_dict().items():
        for ours, theirs in renames.items():
            name = name.replace(ours, theirs)
        state[name if name.startswith("lm_head") else f"model.{name}"] = value
    reference.load_state_dict(state, strict=True)
    tokens = bundle.example_inputs[0]
    torch.testing.assert_close(bundle.model(tokens), reference(tokens).logits)


def test_bert_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    bundle = build_model("bert:dropout=0.0", device="cpu", seed=0)
    config = bundle.config
    reference = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=config.vocab, hidden_size=config.hidden, num_hidden_layers=config.layers,
            num_attention_heads=config.heads, intermediate_size=config.ffn_hidden,
            max_position_embeddings=config.seq, type_vocab_size=config.token_types,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    ).eval()
    renames = {
        "embed_norm.": "bert.embeddings.LayerNorm.",
        "word_embeddings.": "bert.embeddings.word_embeddings.",
        "position_embeddings.": "bert.embeddings.position_embeddings.",
        "token_type_embeddings.": "bert.embeddings.token_type_embeddings.",
        "layers.": "bert.encoder.layer.",
        ".attn.q_proj.": ".attention.self.query.",
        ".attn.k_proj.": ".attention.self.key.",
        ".attn.v_proj.": ".attention.self.value.",
        ".attn.o_proj.": ".attention.output.dense.",
        ".attn_norm.": ".attention.output.LayerNorm.",
        ".mlp.fc_in.": ".intermediate.dense.",
        ".mlp.fc_out.": ".output.dense.",
        ".mlp_norm.": ".output.LayerNorm.",
        "mlm_head.dense.": "cls.predictions.transform.dense.",
        "mlm_head.norm.": "cls.predictions.transform.LayerNorm.",
        "mlm_head.decoder_bias": "cls.predictions.bias",
    }
    state = {}
    for name, value in bundle.model.state_dict().items():
        for ours, theirs in renames.items():
            name = name.replace(ours, theirs)
        state[name] = value
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, missing
    reference.tie_weights()
    tokens = bundle.example_inputs[0]
    torch.testing.assert_close(bundle.model(tokens), reference(tokens).logits)

"""Model spec strings: overrides, canonical names, file factories and every error message."""

import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from autopar.errors import ModelSpecError
from autopar.models import FAMILIES, NAMED_SIZES, build_model, list_models, resolve_spec
from autopar.models.gpt import GPTConfig
from autopar.models.spec import format_value, parse_spec, parse_value


def test_overrides_are_typed_and_whitespace_is_tolerated():
    config = resolve_spec("  gpt : layers = 3 , hidden=96, heads=3,dropout=0 ,attention=sdpa ").config
    assert (config.layers, config.hidden, config.heads) == (3, 96, 3)
    assert config.dropout == 0.0 and isinstance(config.dropout, float)
    assert config.attention == "sdpa"
    assert config.ffn_hidden == 4 * 96


def test_optional_and_float_fields():
    assert resolve_spec("gpt:hidden=32,ffn_hidden=none").config.ffn_hidden == 128
    assert resolve_spec("gpt:ffn_hidden=100").config.ffn_hidden == 100
    assert resolve_spec("llama:rope_theta=1e6").config.rope_theta == 1e6
    assert resolve_spec("moe:capacity_factor=2").config.capacity_factor == 2.0
    assert resolve_spec("moe").config.capacity_factor == 0.0 and resolve_spec("moe:router=gshard").config.capacity_factor == 1.25


def test_bool_values_parse():
    assert parse_value("x", "flag", bool, "true") is True
    assert parse_value("x", "flag", bool, "False") is False
    with pytest.raises(ModelSpecError, match="expects true or false, got 'yes'"):
        parse_value("x", "flag", bool, "yes")


def test_family_canonical_name_lists_every_field_and_round_trips():
    resolved = resolve_spec("gpt:layers=3")
    assert resolved.name.startswith("gpt:layers=3,hidden=64,heads=4,")
    assert resolve_spec(resolved.name).config == resolved.config


def test_named_size_canonical_name_keeps_only_real_overrides():
    assert resolve_spec("GPT3-175B").name == "gpt3-175b"
    assert resolve_spec("gpt3-175b:layers=96").name == "gpt3-175b"
    resolved = resolve_spec("gpt3-175b: seq=1024 , layers=8")
    assert resolved.name == "gpt3-175b:layers=8,seq=1024"
    assert (resolved.config.layers, resolved.config.seq, resolved.config.hidden) == (8, 1024, 12288)
    assert resolve_spec(resolved.name).config == resolved.config


def test_tiny_aliases_equal_family_defaults():
    for family in FAMILIES.values():
        assert resolve_spec(f"tiny-{family.name}").config == family.config_cls()


def test_list_models_covers_families_and_named_sizes():
    models = list_models()
    assert set(FAMILIES) | set(NAMED_SIZES) == set(models)
    assert all(description for description in models.values())
    assert "layers=96" in models["gpt3-175b"]


@given(
    layers=st.integers(1, 1024),
    dropout=st.floats(0.0, 0.999, allow_nan=False),
    attention=st.sampled_from(["eager", "sdpa"]),
    ffn_hidden=st.none() | st.integers(1, 10**6),
)
def test_format_then_parse_round_trips(layers, dropout, attention, ffn_hidden):
    config = GPTConfig(layers=layers, dropout=dropout, attention=attention, ffn_hidden=ffn_hidden)
    assert resolve_spec(resolve_spec(f"gpt:{format_value_pairs(config)}").name).config == config


def format_value_pairs(config) -> str:
    names = ("layers", "dropout", "attention", "ffn_hidden")
    return ",".join(f"{name}={format_value(getattr(config, name))}" for name in names)


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("gtp", ["unknown model 'gtp'", "did you mean 'gpt'?", "Known: gpt, llama", "gpt3-175b", ".py:factory"]),
        ("gpt3-17b", ["unknown model 'gpt3-17b'", "did you mean 'gpt3-175b'?"]),
        ("zzzz", ["unknown model 'zzzz'.", "Known:"]),
        ("gpt:hiden=8", ["gpt has no field 'hiden'", "did you mean 'hidden'?", "Fields: layers, hidden"]),
        ("gpt3-175b:hiden=8", ["gpt has no field 'hiden'", "did you mean 'hidden'?"]),
        ("moe:experts=8", ["moe has no field 'experts'", "did you mean 'num_experts'?"]),
        ("gpt:layers=abc", ["gpt field 'layers' expects an int, got 'abc'"]),
        ("gpt:layers=2.5", ["gpt field 'layers' expects an int, got '2.5'"]),
        ("gpt:ffn_hidden=big", ["gpt field 'ffn_hidden' expects an int or 'none', got 'big'"]),
        ("gpt:dropout=lots", ["gpt field 'dropout' expects a number, got 'lots'"]),
        ("gpt:attention=spda", ["field 'attention' expects one of 'eager', 'sdpa'", "did you mean 'sdpa'?"]),
        ("gpt:layers=0", ["gpt field 'layers' must be positive, got 0"]),
        ("gpt:vocab=-5", ["gpt field 'vocab' must be positive, got -5"]),
        ("gpt:hidden=64,heads=5", ["hidden (64) must be divisible by heads (5)", "heads=4"]),
        ("gpt:dropout=1.5", ["gpt field 'dropout' must be in [0, 1), got 1.5"]),
        ("llama:rope_theta=nan", ["llama field 'rope_theta' expects a finite number, got nan"]),
        ("llama:heads=4,kv_heads=3", ["heads (4) must be divisible by kv_heads (3)", "kv_heads=4"]),
        ("llama:hidden=12,heads=4", ["head dim hidden/heads = 3 must be even"]),
        ("vit:image_size=30,patch=8", ["image_size (30) must be divisible by patch (8)"]),
        ("moe:top_k=5,num_experts=4", ["top_k (5) must be at most num_experts (4)"]),
        ("moe:capacity_factor=-1", ["moe field 'capacity_factor' must be >= 0"]),
        ("gpt:layers", ["override 'layers' in model spec 'gpt:layers' is not key=value"]),
        ("gpt:layers=", ["field 'layers' in model spec 'gpt:layers=' has no value"]),
        ("gpt:layers=2,layers=3", ["field 'layers' is set twice"]),
        ("", ["model spec is empty"]),
        (":layers=2", ["has no model name before ':'"]),
    ],
)
def test_spec_errors_say_what_and_how(spec, fragments):
    with pytest.raises(ModelSpecError) as error:
        resolve_spec(spec)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_configs_built_in_python_check_types():
    with pytest.raises(ModelSpecError, match="gpt field 'layers' expects an int, got '2'"):
        GPTConfig(layers="2")
    with pytest.raises(ModelSpecError, match="gpt field 'layers' expects an int, got True"):
        GPTConfig(layers=True)


def test_build_arguments_are_checked():
    with pytest.raises(ModelSpecError, match="batch_size must be a positive int"):
        build_model("gpt", batch_size=0)
    with pytest.raises(ModelSpecError, match="is not a torch device"):
        build_model("gpt", device="gpu7")
    with pytest.raises(ModelSpecError, match="must be a string"):
        build_model(42)


# --- file.py:factory ----------------------------------------------------------------------------

FACTORIES = textwrap.dedent(
    """
    import torch

    def make_pair():
        return torch.nn.Linear(4, 2), torch.randn(3, 4)

    def make_triple():
        return torch.nn.Linear(4, 2), (torch.randn(3, 4),), torch.nn.functional.mse_loss

    def make_dict():
        return {"model": torch.nn.Linear(4, 2), "example_inputs": (torch.randn(3, 4),),
                "loss_fn": torch.nn.functional.mse_loss, "example_targets": torch.randn(3, 2)}

    def make_broken():
        raise RuntimeError("weights not found at /nowhere")

    def make_string():
        return "a model"

    def make_not_module():
        return 3, torch.randn(3, 4)

    def make_bad_inputs():
        return torch.nn.Linear(4, 2), 7

    def make_bad_dict():
        return {"net": torch.nn.Linear(4, 2)}

    not_callable = 5
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(FACTORIES)
    return path


@pytest.mark.parametrize("factory", ["make_pair", "make_triple", "make_dict"])
def test_file_factory_results_are_wrapped(model_file, factory):
    bundle = build_model(f"{model_file}:{factory}", device="cpu", seed=0)
    assert bundle.name == f"{model_file}:{factory}"
    assert bundle.config is None
    assert isinstance(bundle.model, torch.nn.Linear)
    assert len(bundle.example_inputs) == 1 and bundle.example_inputs[0].shape == (3, 4)
    assert (bundle.loss_fn is None) == (factory == "make_pair")
    assert (bundle.example_targets is None) == (factory != "make_dict")


def test_file_factory_runs_on_the_requested_device(model_file):
    bundle = build_model(f"{model_file} : make_pair")
    assert bundle.model.weight.is_meta and bundle.example_inputs[0].is_meta


@pytest.mark.parametrize(
    ("factory", "fragments"),
    [
        ("make_pear", ["has no attribute 'make_pear'", "did you mean 'make_pair'?", "Callables there:"]),
        ("make_broken", ["'make_broken'", "raised RuntimeError: weights not found at /nowhere"]),
        ("make_string", ["returned a str", "returns (model, example_inputs)"]),
        ("make_not_module", ["returned an int as the model", "torch.nn.Module"]),
        ("make_bad_inputs", ["returned an int as example_inputs", "tuple of positional inputs"]),
        ("make_bad_dict", ["returned a dict with keys ['net']", "'example_inputs'"]),
        ("not_callable", ["is an int, not a function"]),
    ],
)
def test_file_factory_errors(model_file, factory, fragments):
    with pytest.raises(ModelSpecError) as error:
        build_model(f"{model_file}:{factory}")
    for fragment in fragments:
        assert fragment in str(error.value)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelSpecError, match="model file 'nope/model.py' not found.*defines make_model"):
        build_model("nope/model.py:make_model")


def test_file_spec_without_factory_or_with_overrides(model_file):
    with pytest.raises(ModelSpecError, match="names no factory; write '.*user_model.py:make_model'"):
        parse_spec(str(model_file))
    with pytest.raises(ModelSpecError, match="file factories take none"):
        parse_spec(f"{model_file}:make_pair:layers=2")
    with pytest.raises(ModelSpecError, match="is not a Python function name"):
        parse_spec(f"{model_file}:make-pair")


def test_model_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def make(:\n")
    with pytest.raises(ModelSpecError, match="importing model file .* failed: SyntaxError"):
        build_model(f"{path}:make")

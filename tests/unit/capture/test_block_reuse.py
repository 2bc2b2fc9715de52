"""block_match.py / block_reuse.py: capture N identical blocks by tracing three.

The graph built from three traced blocks equals the full capture node for node (names, module
paths, parameters, FLOPs, blocks and segments), so the plan is the same; blocks that are not
interchangeable (different widths, behaviour that depends on the layer, ops between layers, a
head that reads every layer) get the full capture.
"""

from __future__ import annotations

import functools
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import api
from autopar.plans import planning
from autopar.capture.block_reuse import capture_reusing_blocks
from autopar.capture.block_match import repeated_blocks
from autopar.capture.export import capture

ALL = os.environ.get("AUTOPAR_BLOCK_REUSE") == "all"
"""AUTOPAR_BLOCK_REUSE=all also compares the other built-in families and more Hugging Face
architectures (GPT-2, T5, BLOOM, Falcon, Mixtral, Gemma: a few minutes more; T5 alone takes
30-80 s here, BiasStack below checks its leading-child layout by default)."""
BUILT_IN = ["gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128",
            "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=176,seq=32,vocab=128",
            *(["moe:layers=4", "bert:layers=4", "vit:layers=4"] if ALL else [])]


def reused_capture(*args, **kwargs):
    """capture_for_planning with the shortcut's own errors raised; fails if it was not used."""
    used = []

    def strict(*inner_args, **inner_kwargs):
        graph = capture_reusing_blocks(*inner_args, **inner_kwargs, strict=True)
        used.append(graph is not None)
        return graph

    with mock.patch.object(planning, "capture_reusing_blocks", strict):
        graph = api.capture_for_planning(*args, **kwargs)
    assert used == [True], "the blocks were not reused"
    return graph


@functools.lru_cache(maxsize=None)
def planning_graphs(spec: str):
    """(reused, full) planning captures of a built-in model."""
    return reused_capture(spec), api.capture_for_planning(spec, reuse_blocks=False)


def reused_strictly(model: nn.Module, inputs: tuple, kwargs: dict | None = None, **loss):
    """The reused capture, with the shortcut's own errors raised (None when it does not apply)."""
    return capture_reusing_blocks(model, inputs, kwargs or {}, strict=True, **loss)


@pytest.mark.parametrize("spec", BUILT_IN)
def test_built_in_models_capture_the_same_graph_from_three_blocks(spec):
    reused, full = planning_graphs(spec)
    assert reused == full
    assert [node.name for node in reused.nodes] == [node.name for node in full.nodes]
    assert reused.blocks[0].num_instances == int(spec.split("layers=")[1].split(",")[0])
    assert reused.num_params == full.num_params and reused.fwd_flops == full.fwd_flops


def test_plan_is_the_same_as_with_the_full_capture():
    spec = BUILT_IN[1]
    reused, full = planning_graphs(spec)
    plans = [api.plan(graph, cluster="dgx-a100-80g:gpus_per_node=4", global_batch=8).to_dict() for graph in (reused, full)]
    assert [without_timings(plan) for plan in plans[:1]] == [without_timings(plan) for plan in plans[1:]]
    assert plans[0]["placements"] and plans[0]["predicted"] == plans[1]["predicted"]


def without_timings(value):
    """A plan's dict without the solver's wall-clock times."""
    if isinstance(value, dict):
        return {key: without_timings(item) for key, item in value.items() if not key.endswith("time_s")
                or key == "step_time_s"}
    if isinstance(value, list):
        return [without_timings(item) for item in value]
    return value


_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=32)
HF_MODELS = {  # name: (config class, model class, fields), each small, with `layers` layers
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_head=4, n_positions=32)),
    # repeats with a period of two (sliding-window and global layers)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8, **_LLAMA_LIKE)),
    # encoder and decoder, each with a first block unlike the others (relative position bias)
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=64, d_kv=16, d_ff=128, num_heads=4,
                                                          decoder_start_token_id=0)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_head=4)),  # gaps in export's numbering
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_attention_heads=4)),  # lifted constants
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, **_LLAMA_LIKE)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, **_LLAMA_LIKE)),  # a partial per layer
}
HF_LAYERS = {"gemma2": 8, "t5": 5}
"""Layers of each (4 unless said): more than are traced (three periods after the leading ones)."""
_LAYER_FIELD = {"gpt2": "n_layer", "bloom": "n_layer", "t5": "num_layers"}


def hf_model(name: str, layers: int | None = None) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_name, model_name, fields = HF_MODELS[name]
    layers = layers or HF_LAYERS.get(name, 4)
    config = getattr(transformers, config_name)(vocab_size=128, bos_token_id=0, eos_token_id=0, use_cache=False,
                                                **{_LAYER_FIELD.get(name, "num_hidden_layers"): layers}, **fields)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def token_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


@pytest.mark.parametrize("name", sorted(HF_MODELS) if ALL else ["gemma2", "llama"])
def test_hugging_face_models_capture_the_same_graph_from_three_blocks(name):
    model = hf_model(name)
    tokens = torch.randint(0, 128, (2, 16))
    kwargs = {"input_ids": tokens, **({"decoder_input_ids": tokens} if name == "t5" else {})}
    loss = dict(loss_fn=token_loss, example_targets=torch.randint(0, 128, (2, 16)))
    fast = reused_capture(model, kwargs, **loss)
    assert fast == api.capture_for_planning(model, kwargs, reuse_blocks=False, **loss)
    num_containers = 2 if name == "t5" else 1
    assert sum(group.num_instances for group in fast.blocks) == num_containers * HF_LAYERS.get(name, 4)


class Layer(nn.Module):
    def __init__(self, width: int, index: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.index = index

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class IndexDependent(Layer):
    """Same modules in every layer, but every third layer runs another activation."""

    def forward(self, x):
        out = self.linear(x)
        return (torch.tanh(out) if self.index % 3 == 2 else torch.relu(out)) + x


class Stack(nn.Module):
    def __init__(self, layers, mode: str = "chain") -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(16, 4)
        self.mode = mode

    def forward(self, x):
        outputs = []
        for layer in self.layers:
            x = layer(x)
            if self.mode == "scaled":
                x = x * 0.5  # an op of the parent between layers
            outputs.append(x)
        if self.mode == "sum":
            x = torch.stack(outputs).sum(0)  # the head reads every layer
        return self.head(x)


class Flagged(Layer):
    """A choice made at construction (as Gemma-2's sliding window): an attribute that differs."""

    def __init__(self, width: int, index: int) -> None:
        super().__init__(width, index)
        self.gated = index == 3

    def forward(self, x):
        out = self.linear(x)
        return (out * torch.sigmoid(out) if self.gated else torch.relu(out)) + x


NOT_ALIKE = {  # told apart by their modules
    "different widths": lambda: Stack([nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)),
                                       nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16))]),
    "a flag set per layer": lambda: Stack([Flagged(16, index) for index in range(4)]),
}
NOT_SHIFTED = {  # told apart by the traced blocks
    "behaviour that follows the index": lambda: Stack([IndexDependent(16, index) for index in range(4)]),
    "ops between layers": lambda: Stack([Layer(16) for _ in range(4)], mode="scaled"),
    "head reads every layer": lambda: Stack([Layer(16) for _ in range(4)], mode="sum"),
}


@pytest.mark.parametrize("case", sorted(NOT_ALIKE) + sorted(NOT_SHIFTED))
def test_blocks_that_are_not_interchangeable_get_the_full_capture(case):
    model = {**NOT_ALIKE, **NOT_SHIFTED}[case]().to("meta")
    inputs = (torch.empty(2, 16, device="meta"),)
    assert (repeated_blocks(model) == ()) == (case in NOT_ALIKE)
    assert reused_strictly(model, inputs) is None
    assert api.capture_for_planning(model, inputs) == api.capture_for_planning(model, inputs, reuse_blocks=False)


def test_a_chain_of_plain_layers_is_reused():
    model = Stack([Layer(16) for _ in range(5)]).to("meta")
    inputs = (torch.empty(2, 16, device="meta"),)
    (found,) = repeated_blocks(model)
    assert found.container == "layers" and found.num_children == 5
    fast = reused_strictly(model, inputs, name="Stack")
    assert fast == capture(model, inputs, name="Stack")
    assert [param.name for param in fast.params][:4] == ["layers.0.linear.weight", "layers.0.linear.bias",
                                                        "layers.1.linear.weight", "layers.1.linear.bias"]
    assert fast.params[-3].name == "layers.4.linear.bias"
    assert len(model.layers) == 5  # the model is restored


class Alternating(Flagged):
    """Every other layer gated, as Gemma-2 alternates sliding-window and global attention."""

    def __init__(self, width: int, index: int) -> None:
        super().__init__(width, index)
        self.gated = index % 2 == 1


class Approximate(Layer):
    """An activation made per layer as transformers' ACT2FN makes it: a new functools.partial."""

    def __init__(self, width: int, index: int = 0) -> None:
        super().__init__(width, index)
        self.act = functools.partial(F.gelu, approximate="tanh")

    def forward(self, x):
        return self.act(self.linear(x)) + x


class LiftsAConstant(Layer):
    """Its forward makes a tensor (export lifts one constant per layer, numbered over the model)."""

    def forward(self, x):
        scale = torch.tensor([0.5, 2.0], device=x.device).repeat(x.shape[-1] // 2)
        return torch.relu(self.linear(x)) * scale + x


class BiasFirst(nn.Module):
    """The first layer alone owns a bias that every later layer reads (T5's relative position bias)."""

    def __init__(self, width: int, first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(width)) if first else None

    def forward(self, x, bias=None):
        if self.bias is not None:
            bias = torch.tanh(self.bias)
        return torch.relu(self.linear(x)) + x + bias, bias


class BiasStack(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BiasFirst(16, index == 0) for index in range(num_layers))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        bias = None
        for layer in self.layers:
            x, bias = layer(x, bias)
        return self.head(x)


REPEATING = {  # (model, (first, period) expected)
    "a period of two": (lambda: Stack([Alternating(16, index) for index in range(8)]), (0, 2)),
    "a first layer unlike the rest": (lambda: BiasStack(5), (1, 1)),
    "an activation made per layer": (lambda: Stack([Approximate(16) for _ in range(4)]), (0, 1)),
    "a constant lifted per layer": (lambda: Stack([LiftsAConstant(16) for _ in range(5)]), (0, 1)),
}


@pytest.mark.parametrize("case", sorted(REPEATING))
def test_repeating_layers_are_reused(case):
    build, layout = REPEATING[case]
    model = build().to("meta")
    inputs = (torch.empty(2, 16, device="meta"),)
    (found,) = repeated_blocks(model)
    assert (found.first, found.period) == layout
    fast = reused_strictly(model, inputs, name="Stack")
    assert fast is not None and fast == capture(model, inputs, name="Stack")


def test_a_period_that_does_not_divide_the_layers_gets_the_full_capture():
    model = Stack([Alternating(16, index) for index in range(7)]).to("meta")
    inputs = (torch.empty(2, 16, device="meta"),)
    assert repeated_blocks(model) == ()
    assert api.capture_for_planning(model, inputs) == api.capture_for_planning(model, inputs, reuse_blocks=False)

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
from autopar.block_reuse import capture_reusing_blocks
from autopar.block_match import repeated_blocks
from autopar.capture import capture

ALL = os.environ.get("AUTOPAR_BLOCK_REUSE") == "all"
"""AUTOPAR_BLOCK_REUSE=all also compares the other built-in families and GPT-2 (a minute more)."""
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

    with mock.patch.object(api, "capture_reusing_blocks", strict):
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


def hf_model(name: str, layers: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                         bos_token_id=0, eos_token_id=0, use_cache=False)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def token_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


@pytest.mark.parametrize("name", ["llama", "gpt2"] if ALL else ["llama"])
def test_hugging_face_models_capture_the_same_graph_from_three_blocks(name):
    model = hf_model(name)
    kwargs = {"input_ids": torch.randint(0, 128, (2, 16))}
    loss = dict(loss_fn=token_loss, example_targets=torch.randint(0, 128, (2, 16)))
    fast = reused_capture(model, kwargs, **loss)
    assert fast == api.capture_for_planning(model, kwargs, reuse_blocks=False, **loss)
    assert fast.blocks[0].num_instances == 4


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

"""`autopar verify` end to end: a tiny built-in model's kinds and two Hugging Face models given as
factories (GPT-2, Llama) on 2 spawned gloo processes match one process, and a wrong reference
shows as MISMATCH with exit status 1; a factory whose dropout is a call in forward matches under
tp and is labelled "random" (drawn per replica) under dp."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main

pytestmark = pytest.mark.dist

MODEL = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"


def test_every_kind_of_a_tiny_gpt_matches_one_process(capsys):
    code = main(["verify", MODEL, "--nproc", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    cells = {cell["kind"]: cell for cell in report["cells"]}
    assert code == 0 and report["ok"], report
    for kind in ("dp", "tp", "pp"):
        assert cells[kind]["result"] == "match", cells[kind]
        assert cells[kind]["max_deviation"] <= report["tolerance"]
        assert len(cells[kind]["losses"]) == 3
    assert cells["tp"]["sharded_params"] > 0  # the planner really split the matmuls
    assert cells["cp"]["result"] == "n/a" and "scaled_dot_product_attention" in cells["cp"]["reason"]
    assert cells["ep"]["result"] == "n/a" and "expert" in cells["ep"]["reason"]
    assert cells["zero3"]["result"] == "match" and cells["recompute"]["result"] == "match"
    assert cells["interleaved"]["result"] == "match"  # 2 chunks per stage: layers, embedding and head


def test_a_mixture_of_experts_matches_under_expert_parallelism_and_zero(capsys):
    code = main(["verify", "qwen3-30b-a3b", "--nproc", "2", "--kinds", "ep,epxzero3", "--steps", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report
    assert report["model"].startswith("moe:") and "num_experts=4" in report["model"]
    for cell in report["cells"]:
        assert cell["result"] == "match" and "ep=2" in cell["mesh"] and cell["sharded_params"] > 0, cell


def test_a_wrong_reference_is_a_mismatch_and_exit_status_1(capsys, monkeypatch):
    from autopar.tune import verify

    exact = verify.reference_losses
    monkeypatch.setattr(verify, "reference_losses", lambda setup: [loss + 1e-3 for loss in exact(setup)])
    code = main(["verify", MODEL, "--nproc", "2", "--kinds", "tp", "--steps", "1"])
    table = capsys.readouterr().out.splitlines()
    assert code == 1
    assert table[2].startswith("tp ") and table[2].endswith("MISMATCH")
    assert table[-1].endswith("1 MISMATCH; NOT exact")


HF_FACTORY = '''
import torch
import torch.nn.functional as F
import transformers


class TokensOnly(torch.nn.Module):
    """A Hugging Face causal LM called with input_ids only (a factory's inputs are positional)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def make(batch_size=4):
    config = transformers.{config}({sizes})
    model = TokensOnly(transformers.{model}(config))
    tokens = torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(0))
    return model, (tokens,), loss_fn, tokens
'''
HF_MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=128"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
              "num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, vocab_size=128"),
}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_a_hugging_face_model_from_a_factory_matches_under_dp_tp_pp(capsys, tmp_path, name):
    pytest.importorskip("transformers")
    config, model, sizes = HF_MODELS[name]
    path = tmp_path / f"hf_{name}.py"
    path.write_text(HF_FACTORY.format(config=config, model=model, sizes=sizes))
    code = main(["verify", f"{path}:make", "--nproc", "2", "--kinds", "dp,tp,pp", "--steps", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    cells = {cell["kind"]: cell for cell in report["cells"]}
    assert code == 0 and report["ok"], report
    assert all(cells[kind]["result"] == "match" for kind in ("dp", "tp", "pp")), cells
    assert cells["tp"]["sharded_params"] > 0, cells["tp"]


NOISY_FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn


class Noisy(nn.Module):
    """An MLP block whose dropout is a call in forward (verify sets only nn.Dropout modules to 0)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.down(F.dropout(F.gelu(self.up(x)), 0.2, self.training)))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make(batch_size=4):
    tokens = torch.randint(0, 64, (batch_size, 16), generator=torch.Generator().manual_seed(0))
    return Noisy(), (tokens,), loss_fn, tokens
'''


def test_random_ops_match_under_tp_and_are_labelled_per_replica_under_dp(capsys, tmp_path):
    path = tmp_path / "noisy.py"
    path.write_text(NOISY_FACTORY)
    code = main(["verify", f"{path}:make", "--nproc", "2", "--kinds", "dp,tp", "--steps", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    cells = {cell["kind"]: cell for cell in report["cells"]}
    assert code == 0 and report["ok"], report
    assert cells["tp"]["result"] == "match" and cells["tp"]["sharded_params"] > 0, cells["tp"]
    assert cells["dp"]["result"] == "random", cells["dp"]
    assert "dp=2 replicas" in cells["dp"]["reason"] and "aten.dropout.default" in cells["dp"]["reason"]

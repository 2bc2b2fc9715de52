"""Which linears precision "fp8" runs in float8 (solver/fp8.py), on captured graphs."""

from __future__ import annotations

import pytest

import autopar
from autopar.solver.fp8 import fp8_linears, linear_weights

LLAMA = "llama:layers=2,hidden=64,heads=4,ffn_hidden=72,seq=16,vocab=64"
GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64"


@pytest.fixture(scope="module")
def llama():
    return autopar.capture_for_planning(LLAMA)


def test_default_rule_skips_the_head_and_dims_not_multiples_of_16(llama):
    chosen = fp8_linears(llama)
    # q, k, v, o of both layers; SwiGLU's 72-wide projections and the lm_head stay in bf16.
    assert chosen == tuple(sorted(f"layers.{layer}.attn.{name}_proj.weight" for layer in (0, 1)
                                  for name in ("q", "k", "v", "o")))
    assert "lm_head.weight" not in chosen
    assert all(".mlp." not in name for name in chosen)


def test_a_weight_tied_to_the_embedding_stays_in_high_precision():
    graph = autopar.capture_for_planning(GPT)
    names = {fqn for _, fqn, _ in linear_weights(graph)}
    assert "wte.weight" not in names  # GPT's head reads the embedding table: not a linear-only weight
    assert len(fp8_linears(graph)) == 12


def test_a_filter_replaces_the_default_rule(llama):
    seen = []

    def keep(fqn: str, shape: tuple[int, ...]) -> bool:
        seen.append((fqn, shape))
        return fqn.endswith("down_proj") or fqn == "lm_head"

    chosen = fp8_linears(llama, keep)
    assert chosen == ("layers.0.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight", "lm_head.weight")
    assert ("layers.0.mlp.down_proj", (64, 72)) in seen

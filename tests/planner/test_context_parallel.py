"""The planner chooses context parallelism where long sequences need it, and not otherwise.

Llama 3 405B's per-layer shape (hidden 16384, 128 heads, 8 KV heads, FFN 53248, vocab 128256)
on 16,384 H100s with a global batch of 16M tokens, as Meta's training ran it (Dubey et al.
2024, Table 4): at sequence 131072 (128 sequences per step) Meta used cp 16; at 8192 (2048
sequences) no cp. The model has LAYERS layers instead of 126 to keep capture short; what cp
changes (tokens per rank, per-layer activations, KV bytes per layer) is per layer, and 16
layers still fill a 16-stage pipeline.
"""

import pytest

import autopar

LAYERS = 4
SHAPE = "hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,vocab=128256"
CLUSTER = "dgx-h100:nodes=2048"
TOKENS_PER_STEP = 16 * 2**20


def _plan(seq: int):
    model = f"llama:layers={LAYERS},{SHAPE},seq={seq}"
    return autopar.plan(model, cluster=CLUSTER, global_batch=TOKENS_PER_STEP // seq)


def test_long_sequences_are_split_over_context_parallel_ranks():
    plan = _plan(131072)
    assert plan.mesh["cp"] > 1, plan.summary()
    assert plan.mesh["tp"] * plan.mesh["cp"] * plan.mesh["pp"] * plan.mesh["dp"] == 16384
    assert plan.predicted.fits
    names = set(plan.predicted.breakdown_s)
    assert {"cp.kv_all_gather", "cp.kv_reduce_scatter"} <= names


def test_8k_sequences_need_no_context_parallelism():
    plan = _plan(8192)
    assert plan.mesh["cp"] == 1, plan.summary()

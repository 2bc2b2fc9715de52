"""The planner chooses context parallelism where long sequences need it, and not otherwise.

Llama 3 405B's per-layer shape (hidden 16384, 128 heads, 8 KV heads, FFN 53248, vocab 128256)
on 16,384 H100s with a global batch of 16M tokens, as Meta's training ran it (Dubey et al.
2024, Table 4: cp 16 at sequence 131072, no cp at 8192). The models have fewer layers than
126 to keep capture short (126 layers take minutes here); what cp changes (tokens per rank,
per-layer activations, KV bytes per layer) is per layer. At 8192 the comparison is between
pipelines, so the model keeps 16 layers (a 16-stage pipeline, as Meta's); at 131072 4 layers
show the same need.

At 131072 tokens a step holds 128 sequences for 16,384 GPUs: without cp no mesh runs it (a
data-parallel degree dividing 128 leaves >= 128 GPUs per sequence, more than tp x pp can take),
so the planner must split sequences. At 8192 (2048 sequences) cp is not needed: a plan without
it fits. The cost model does find cp plans faster at 8192: on main of 2026-12-01 17:10 UTC (K/V
gathered at their 8 kv heads, NCCL protocol terms) pp8 x dp128 x cp8 x tp2 zb1p at 1.07 s
against pp4 x dp512 x tp8 zb1p at 1.33 s (+24%). Most of the difference is the pipeline bubble
and the once-per-step dp collectives: without cp, 16,384 GPUs and 2048 sequences leave 4
microbatches per pipeline of this 16-layer model (Meta's 126 layers on pp16 had 16). No measured
run backs or refutes the cp plan, so the test asserts where the gap comes from and bounds it.
The planners here price the tensor-parallel collectives exposed (tp_overlap "off"): with async TP
(the CUDA default, codegen/async_tp.py) at 8192 pp8 x dp128 x cp2 x tp8 (1.059 s) and the best
plan without cp, pp4 x dp512 x tp8 (1.081 s), tie within 2%, the cp plan with 18% more compute.
"""

import pytest

from autopar import api
from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.solver.constraints import Constraints

SHAPE = "hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,vocab=128256"
CLUSTER = "dgx-h100:nodes=2048"
TOKENS_PER_STEP = 16 * 2**20


def _planner(seq: int, layers: int):
    model = f"llama:layers={layers},{SHAPE},seq={seq}"
    return api.planner_for(model, None, Cluster.from_spec(CLUSTER), global_batch=TOKENS_PER_STEP // seq,
                           tp_overlap="off")


def test_long_sequences_are_split_over_context_parallel_ranks():
    planner = _planner(131072, layers=4)
    plan = api.plan_with(planner)
    assert plan.mesh["cp"] > 1, plan.summary()
    assert plan.mesh["tp"] * plan.mesh["cp"] * plan.mesh["pp"] * plan.mesh["dp"] == 16384
    assert plan.predicted.fits
    assert {"cp.kv_all_gather", "cp.kv_reduce_scatter"} <= set(plan.predicted.breakdown_s)
    with pytest.raises(AutoparError):
        api.plan_with(planner, Constraints(cp=1))


def test_8k_sequences_need_no_context_parallelism():
    planner = _planner(8192, layers=16)
    best, without = api.plan_with(planner), api.plan_with(planner, Constraints(cp=1))
    assert without.mesh["cp"] == 1 and without.predicted.fits
    gap_s = without.predicted.step_time_s - best.predicted.step_time_s
    assert gap_s <= 0.3 * best.predicted.step_time_s, (best.summary(), without.summary())
    # At 8K tokens cp saves no compute (attention is a small share): the plans' compute differs
    # only by their kernels' shapes (tp 4 or 8, microbatch 1 or 2: a few percent), and what
    # separates them is how the mesh lays out (pipeline fill, collectives over dp, tp and pp).
    compute = lambda plan: plan.predicted.breakdown_s["compute"]  # noqa: E731
    assert compute(best) == pytest.approx(compute(without), rel=0.05), (best.summary(), without.summary())
    layout = lambda plan: sum(seconds for term, seconds in plan.predicted.breakdown_s.items()  # noqa: E731
                              if term == "bubble" or term.split(".")[0] in ("dp", "tp", "pp"))
    assert layout(without) - layout(best) >= 0.5 * gap_s, (best.summary(), without.summary())

"""The built-in `moe` family (grouped-mm experts, dropless) under parallel plans, against one process.

Two tiny models: grouped-query attention with the softmax router, and latent attention with the
sigmoid router, a shared expert and one leading dense layer. Each trains 3 SGD steps under dp2 x
ep2 (ZeRO-0: the two data-parallel ranks split the experts, tokens exchanged by uneven
all-to-alls) and under pp2, and must give one process's losses and first gradients (fp32:
round-off tolerance). The harness is one_process.py's, as in test_experts_runs.py.
"""

from __future__ import annotations

import os

import pytest

from harness import case_outcome  # noqa: F401 (a fixture)
from one_process import BuiltinCase as Case
from one_process import CaseTable, case_param, train_builtin

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
NUM_STEPS = 3
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
_TINY = f"hidden=32,heads=4,seq={SEQ},vocab={VOCAB},num_experts=4,top_k=2,expert_ffn_hidden=32"
SPECS = {
    "gqa-softmax": f"moe:layers=2,{_TINY},kv_heads=2,router=softmax",
    "mla-sigmoid": f"moe:layers=3,{_TINY},dense_layers=1,ffn_hidden=48,shared_experts=1,router=sigmoid,"
                   "attention=mla,q_lora_rank=16,kv_lora_rank=16,qk_nope_head_dim=8,qk_rope_head_dim=4,v_head_dim=8",
    "gqa-oss": f"moe:layers=2,{_TINY},kv_heads=2,router=softmax,expert_bias=true,swiglu_limit=7,sliding_window=4",
    # 3 experts do not split over tp = 2: the tp solve runs them column- then row-parallel (gate
    # and up interleaved in w_gate_up, as Megatron-Core's expert tensor parallelism)
    "gqa-oss-3": f"moe:layers=2,{_TINY.replace('num_experts=4', 'num_experts=3')},kv_heads=2,router=softmax,"
                 "expert_bias=true,swiglu_limit=7",
}



def moe_case(case: Case) -> dict:
    module, run, reference = train_builtin(SPECS[case.model], case.world_size, case.constraints,
                                           global_batch=GLOBAL_BATCH, seq=SEQ, vocab=VOCAB, num_steps=NUM_STEPS,
                                           learning_rate=LEARNING_RATE)
    plan = module.plan
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), ep=plan.ep, ep_params=list(plan.ep_params),
                pp=plan.mesh.get("pp", 1), load=module.expert_load())


EP = dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4)
_EP_ALL = pytest.mark.skipif(not os.environ.get("AUTOPAR_EP_ALL"), reason="more expert cases: set AUTOPAR_EP_ALL=1")
PP = dict(dp=1, tp=1, pp=2, zero_stage=0, microbatch_size=4)
TABLE = CaseTable([
    case_param(Case(model, 2, constraints), f"{model}-{kind}")
    for model in ("gqa-softmax", "mla-sigmoid") for kind, constraints in (("dp2-ep2", EP), ("pp2", PP))
] + [
    # GPT-OSS's keys: the gate/up bias inside the chain (on the rank's block of the bias), the down
    # bias after the combine, the clamped GLU, a sliding window on the first block (query blocks);
    # and with tp2 (the biases split by column with the grouped matmul's columns).
    case_param(Case("gqa-oss", 2, EP), "gqa-oss-dp2-ep2", _EP_ALL),
    case_param(Case("gqa-oss", 2, dict(dp=1, tp=2, pp=1, zero_stage=0, microbatch_size=4)), "gqa-oss-tp2", _EP_ALL),
    case_param(Case("gqa-oss-3", 2, dict(dp=1, tp=2, pp=1, zero_stage=0, microbatch_size=4)),
               "gqa-oss-columns-tp2"),
] + [
    # Each layer's grouped expert matmuls run as one chain: recomputed whole (the dispatch, counts
    # and combine again), or the SwiGLU between them run again on the dispatched rows.
    case_param(Case("gqa-softmax", 2, dict(EP, recompute=mode)), f"gqa-softmax-dp2-ep2-{mode}")
    for mode in ("full", "selective")
])
CASES = TABLE.cases


@TABLE.parametrize
def test_moe_family_matches_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, moe_case, case_name)
    for rank, result in enumerate(results):
        assert result["ep"] == case.constraints.get("ep", 1), result
        if result["ep"] > 1:
            assert {name.rsplit(".", 1)[-1] for name in result["ep_params"]} == {"w_gate_up", "w_down"}
        assert result["pp"] == case.constraints["pp"]
        # The router's measured load: the busiest ep rank's rows over the mean, per expert layer
        # (one per MoE layer, the first op of its chain: all models have 2), the same on every rank.
        if result["ep"] > 1:
            assert len(result["load"]) == 2 and all(1.0 <= v <= result["ep"] for v in result["load"].values())
            assert result["load"] == results[0]["load"]
        else:
            assert result["load"] == {}
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"
        if case.constraints["pp"] == 1:
            assert set(result["grad_errors"]) == set(result["all_parameters"])

"""Recomputation by module ("modules:<kinds>", solver/recompute_modules.py) on 2 gloo processes,
against one process: the tiny built-in MoE recomputing its norms and expert activations under
dp2 x ep2 (the experts' all-to-alls inside the checkpointed segment), the tiny Llama its norms
and attention core under tp2, and a latent-attention MoE its up-projections under dp2. Each trains 3 SGD steps and must give one process's losses and
first gradients (fp32: round-off tolerance); the selective policy must have kept tensors (the
mode ran as a selective checkpoint, not as a full recompute). The harness is one_process.py's."""

from __future__ import annotations

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
SPECS = {
    "moe": f"moe:layers=2,hidden=32,heads=4,seq={SEQ},vocab={VOCAB},num_experts=4,top_k=2,expert_ffn_hidden=32,"
           "kv_heads=2,router=softmax",
    "llama": f"llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq={SEQ},vocab={VOCAB}",
    "mla": f"moe:layers=2,hidden=32,heads=4,seq={SEQ},vocab={VOCAB},num_experts=4,top_k=2,expert_ffn_hidden=32,"
           "router=sigmoid,attention=mla,q_lora_rank=16,kv_lora_rank=16,qk_nope_head_dim=8,qk_rope_head_dim=4,"
           "v_head_dim=8",
}



def modules_case(case: Case) -> dict:
    module, run, reference = train_builtin(SPECS[case.model], case.world_size, case.constraints,
                                           global_batch=GLOBAL_BATCH, seq=SEQ, vocab=VOCAB, num_steps=NUM_STEPS,
                                           learning_rate=LEARNING_RATE)
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), recompute=module.plan.recompute, mesh=module.plan.mesh,
                kept=dict(module.stats.kept))


TABLE = CaseTable([
    case_param(Case("moe", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4,
                                   recompute_modules="layernorm,moe_act")), "moe-dp2-ep2-layernorm-moe_act"),
    case_param(Case("llama", 2, dict(dp=1, tp=2, pp=1, recompute_modules="layernorm,core_attn")),
               "llama-tp2-layernorm-core_attn"),
    # MLA's up-projections with the RoPE and concatenations after them, made again before the
    # attention's backward (Megatron-Core's qkv_up_proj_and_rope_apply)
    case_param(Case("mla", 2, dict(dp=2, tp=1, pp=1, zero_stage=0, microbatch_size=4, recompute_modules="mla_up_proj")),
               "mla-dp2-mla_up_proj"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_modules_recompute_matches_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, modules_case, case_name)
    for rank, result in enumerate(results):
        assert result["recompute"] == "modules:" + case.constraints["recompute_modules"], result["recompute"]
        for axis in ("dp", "tp", "pp"):
            assert result["mesh"].get(axis, 1) == case.constraints[axis], result["mesh"]
        assert result["kept"].get("op", 0) > 0, result["kept"]  # the selective policy kept tensors
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        assert set(result["grad_errors"]) == set(result["all_parameters"])
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"

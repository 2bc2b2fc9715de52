"""Precision "fp8" on MoE experts (torchao's rowwise FP8 grouped GEMM, emulated on CPUs) on real
process groups: dp2 x ep2 (ZeRO-0 and ZeRO-3) against one process running the same recipe."""

from __future__ import annotations

import os

import pytest

from harness import run_workers
from test_fp8_runs import fp8_cluster, global_error

pytestmark = pytest.mark.dist

SPEC = "moe:layers=2,hidden=64,heads=4,seq=16,vocab=64,num_experts=4,top_k=2,expert_ffn_hidden=64"
GLOBAL_BATCH = 8
CONFIGS = (({"dp": 2, "ep": 2, "zero_stage": 0, "microbatch_size": 4}, 4),
           ({"dp": 2, "ep": 2, "zero_stage": 3, "microbatch_size": 4}, 4),
           ({"dp": 2, "ep": 2, "zero_stage": 0, "microbatch_size": 4, "recompute": "full"}, 8),
           ({"pp": 2, "schedule": "1f1b", "microbatch_size": 4, "zero_stage": 0}, 4))
"""(constraints, float8 grouped matmuls each rank runs in the step: 2 per MoE layer it holds per
microbatch, twice under full recomputation). Under ep one microbatch per rank: the rows an expert
gets from the ep group are one process's rows of that expert over the whole batch (the weight
gradient's per-expert scales see the same rows); pp2 runs 2 microbatches of 4 (scaled per
microbatch, against one process's batch of 8: within TOLERANCE, measured 0.031)."""
_ALL = pytest.mark.skipif(not os.environ.get("AUTOPAR_FP8_ALL"),
                          reason="a tiny MoE under 4 fp8 plans against one process (15 s here): "
                                 "set AUTOPAR_FP8_ALL=1")
TOLERANCE = 0.05
"""Gradient error (first-step gradients, relative norm) against one process running the same
recipe: measured 0.021 over every parameter and 0.032 over the expert weights. That is this
model's floor under fp8 at dp2 x ep2, not the experts': with the experts in bf16 in both runs (the
float8 linears alone) it is 0.020 and 0.040. One process's batch of 8 and each rank's 4 round bf16
in other places, and a float8 cast (3 mantissa bits) moves such a last-bit difference to the
neighbouring float8 value. That the expert-parallel grouped matmul itself is one process's, to
bf16 round-off, is the exact test below (test_fp8_grouped_mm_under_ep_is_one_process_grouped_mm)."""
FP8_EFFECT = 0.06
"""The expert weights' gradients against the reference with its experts in bf16 (measured 0.086):
farther than TOLERANCE, so the comparison sees that the experts ran in float8."""
EXACT = 0.01
"""Relative error of one float8 grouped matmul run expert-parallel against one process: the same
casts of the same rows, only float32 sums in another order (measured: bitwise equal)."""


def reference_run(model, loss_fn, tokens, targets, linears: tuple[str, ...], experts: tuple[str, ...], *,
                  float8_experts: bool = True) -> dict:
    """One process, the whole batch as one microbatch, bf16 weights: torchao's rowwise float8
    linears on `linears`, and the experts' grouped matmuls of `experts` run by the same emulated
    recipe (codegen/fp8_experts.py) through the model's own grouped_mm call."""
    import copy

    import torch
    from torchao.float8 import convert_to_float8_training

    import autopar.models.moe_layer as moe_layer
    from autopar.codegen.fp8 import float8_config
    from autopar.codegen.fp8_experts import EmulatedFloat8GroupedMM

    reference = copy.deepcopy(model).to(torch.bfloat16)
    convert_to_float8_training(reference, config=float8_config("rowwise", emulate=True, fsdp_float8_all_gather=False),
                               module_filter_fn=lambda _, fqn: f"{fqn}.weight" in linears)
    float8_weights = {id(reference.get_parameter(fqn)) for fqn in experts} if float8_experts else set()
    original = moe_layer.grouped_mm

    def grouped_mm(tokens, weight, offs):
        if id(weight) in float8_weights:
            return EmulatedFloat8GroupedMM.apply(tokens, weight, offs, torch.bfloat16)
        return original(tokens, weight, offs)

    moe_layer.grouped_mm = grouped_mm
    try:
        loss = loss_fn(reference(tokens).float(), targets)
        loss.backward()
    finally:
        moe_layer.grouped_mm = original
    return dict(loss=loss.item(), grads={name: param.grad.float() for name, param in reference.named_parameters()})


def fp8_experts_worker(cluster: str, configs: tuple) -> list[dict]:
    from autopar.codegen.fp8_experts import Float8GroupedMM
    from autopar.models import build_model
    from one_process import parallelize_reusing_captures

    bundle = build_model(SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    tokens, targets = bundle.example_inputs[0], bundle.example_targets
    calls = []
    grouped_mm = Float8GroupedMM.grouped_mm

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return grouped_mm(self, *args)

    Float8GroupedMM.grouped_mm = counted
    results = []
    try:
        for constraints, expected_calls in configs:
            module = parallelize_reusing_captures("fp8-experts", bundle.model, cluster, (tokens,),
                                                  loss_fn=bundle.loss_fn, example_targets=targets,
                                                  constraints=constraints, precision="fp8", fp8_recipe="rowwise")
            plan = module.plan
            runs = {fp8: reference_run(bundle.model, bundle.loss_fn, tokens, targets, plan.fp8_linears,
                                       plan.fp8_experts, float8_experts=fp8) for fp8 in (True, False)}
            calls.clear()
            loss = module.train_step((tokens,), targets).item()
            grads = {name: param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                     for name, param in module.named_model_parameters().items() if param.grad is not None}
            experts = {name: grads[name] for name in plan.fp8_experts if name in grads}
            results.append(dict(constraints=constraints, expected_calls=expected_calls, ep=plan.ep,
                                experts=plan.fp8_experts,
                                linears=len(plan.fp8_linears), loss=loss, reference_loss=runs[True]["loss"],
                                grad_error=global_error(grads, runs[True]["grads"]),
                                expert_error=global_error(experts, runs[True]["grads"]),
                                fp8_effect=global_error(experts, runs[False]["grads"]),
                                num_calls=len(calls), summary=plan.summary() if hasattr(plan, "summary") else ""))
    finally:
        Float8GroupedMM.grouped_mm = grouped_mm
    return results


@_ALL
def test_fp8_experts_under_dp_ep_zero3_recompute_and_pp_match_one_process(tmp_path):
    """dp2 x ep2 with ZeRO-0, ZeRO-3 (FSDP2 over the expert replicas) and full recomputation, and
    pp2: each rank's experts run torchao's rowwise FP8 grouped GEMM (emulated) on the rows
    dispatched to them, and the first-step gradients are one process's running the same recipe
    on the whole batch (TOLERANCE); the experts' gradients are measurably not bf16's (FP8_EFFECT).
    Not here: tp2 without ep (runs; the experts' gradients are 0.076 from one process's, 0.10
    from bf16's: tensor parallelism's own float8 noise, as test_fp8_runs.TP_TOLERANCE says)."""
    for rank_results in run_workers(fp8_experts_worker, world_size=2, args=(fp8_cluster(2, tmp_path), CONFIGS)):
        for result in rank_results:
            label = result["constraints"]
            assert result["ep"] == label.get("ep", 1), label
            assert {name.rsplit(".", 1)[-1] for name in result["experts"]} == {"w_gate_up", "w_down"}, label
            assert len(result["experts"]) == 4 and result["linears"] > 0, label
            assert result["num_calls"] == result["expected_calls"], label
            assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-3), label
            assert result["grad_error"] < TOLERANCE, (label, result["grad_error"])
            assert result["expert_error"] < TOLERANCE, (label, result["expert_error"])
            assert result["fp8_effect"] > FP8_EFFECT, (label, result["fp8_effect"])


def grouped_mm_under_ep_worker() -> list[float]:
    """Each of 2 ranks holds 2 of 4 experts and its own rows (sorted by expert, uneven counts);
    the rows are dispatched to their experts' ranks (codegen/experts.py), run through the float8
    grouped matmul there and combined back: outputs and gradients against one process's float8
    grouped matmul of every rank's rows with the whole weight."""
    import torch
    import torch.distributed as dist

    from autopar.codegen.experts import grouped_mm_expert_parallel
    from autopar.codegen.fp8_experts import EmulatedFloat8GroupedMM, Float8GroupedMM

    rank, experts, k, n = dist.get_rank(), 4, 32, 48
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(experts, k, n, generator=generator) * 0.1).to(torch.bfloat16)
    counts = [[5, 0, 11, 8], [3, 9, 2, 10]]  # rows per expert on each rank
    tokens = [torch.randn(sum(c), k, generator=generator).to(torch.bfloat16) for c in counts]
    grads = [torch.randn(sum(c), n, generator=generator).to(torch.bfloat16) for c in counts]
    tokens[1][12] *= 40.0  # expert 2 gets rows of both ranks: its per-column scales must see this row
    offs = [torch.tensor(c).cumsum(0).to(torch.int32) for c in counts]

    mine = tokens[rank].clone().requires_grad_()
    local_weight = weight[2 * rank:2 * rank + 2].clone().requires_grad_()
    float8 = Float8GroupedMM((), torch.device("cpu"))
    output = grouped_mm_expert_parallel(lambda rows, w, o: float8.grouped_mm(rows, w, o), mine, local_weight,
                                        offs[rank], dist.group.WORLD, 2)
    output.backward(grads[rank])

    # One process: every rank's rows of expert e together (rank 0's, then rank 1's), the whole weight.
    order = [(source, e, start) for e in range(experts) for source in range(2)
             for start in [sum(counts[source][:e])]]
    whole = torch.cat([tokens[s][start:start + counts[s][e]] for s, e, start in order]).requires_grad_()
    whole_grad = torch.cat([grads[s][start:start + counts[s][e]] for s, e, start in order])
    whole_offs = torch.tensor([counts[0][e] + counts[1][e] for e in range(experts)]).cumsum(0).to(torch.int32)
    whole_weight = weight.clone().requires_grad_()
    expected = EmulatedFloat8GroupedMM.apply(whole, whole_weight, whole_offs, torch.bfloat16)
    expected.backward(whole_grad)
    position, mine_rows = 0, []
    for s, e, start in order:  # this rank's rows of the whole, in its own order
        if s == rank:
            mine_rows.append((start, position, counts[s][e]))
        position += counts[s][e]
    picked = lambda value: torch.cat([value[p:p + c] for _, p, c in sorted(mine_rows)])  # noqa: E731
    pairs = ((output, picked(expected)), (mine.grad, picked(whole.grad)),
             (local_weight.grad, whole_weight.grad[2 * rank:2 * rank + 2]))
    return [float((got.detach().float() - want.detach().float()).norm() / want.float().norm()) for got, want in pairs]


def test_fp8_grouped_mm_under_ep_is_one_process_grouped_mm():
    """The rows each rank's experts get from the ep group are scaled (rowwise, and per expert's
    rows for the weight gradient) as one process scales them: output, token and weight gradients
    equal one process's to float32 summation order."""
    for errors in run_workers(grouped_mm_under_ep_worker, world_size=2):
        assert max(errors) < EXACT, errors

"""bf16 compute with fp32 master weights: the plan's precision policy on real process groups."""

from __future__ import annotations

import pytest

from harness import run_workers, tiny_model_cluster

pytestmark = pytest.mark.dist

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64,dropout=0.0"
CONFIGS = ({"tp": 2, "microbatch_size": 4}, {"dp": 2, "zero_stage": 0, "microbatch_size": 2},
           {"dp": 2, "zero_stage": 3, "microbatch_size": 2},
           {"pp": 2, "schedule": "zbv", "microbatch_size": 2, "zero_stage": 0},
           {"pp": 2, "schedule": "1f1b", "microbatch_size": 2, "zero_stage": 0})
"""Each with two or more microbatches per rank (2 x tp, 2 x dp ZeRO-0 and ZeRO-3, 4 through ZB-V
(torch's weight pass: plain casts) and through 1F1B (the copies add into the fp32 gradients))."""


def _per_use(module):
    """The same module casting every weight at each use (the runtime before copies per step)."""
    from contextlib import nullcontext

    module._weight_copies = nullcontext


def _step(module, tokens, targets) -> dict:
    before = module.weight_casts.num_casts
    loss = module.train_step((tokens,), targets).item()
    params = dict(module.named_model_parameters())
    return dict(loss=loss, casts=module.weight_casts.num_casts - before, params=params,
                grads={name: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                       for name, p in params.items() if p.grad is not None})


def bf16_worker(cluster: str) -> list[dict]:
    import torch

    from autopar.codegen import parallelize as codegen
    from autopar.models import build_model
    from one_process import parallelize_reusing_captures

    bundle = build_model(SPEC, device="cpu", seed=0, batch_size=8)
    reference = build_model(SPEC, device="cpu", seed=0, batch_size=8).model
    tokens, targets = bundle.example_inputs[0], bundle.example_targets
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference_loss = bundle.loss_fn(reference(tokens).float(), targets).item()
    fsdp = codegen.apply_fsdp

    def parallelize(constraints):
        """autopar.parallelize(bundle.model, cluster, (tokens,), ..., precision="bf16"), planned
        from one planning capture and built from one codegen export shared by the configurations
        (the same model each time; the precision is the plan's, applied when the module is built)."""
        return parallelize_reusing_captures("mixed-precision", bundle.model, cluster, (tokens,),
                                            loss_fn=bundle.loss_fn, example_targets=targets,
                                            constraints=constraints, precision="bf16")

    results = []
    for constraints in CONFIGS:
        module = parallelize(constraints)
        runs = {"once": _step(module, tokens, targets)}
        if module.plan.zero_stage == 3:  # FSDP2 gathering fp32, each use casting (no MixedPrecisionPolicy)
            codegen.apply_fsdp = lambda *args, param_dtype=None, **kwargs: fsdp(*args, **kwargs)
            try:
                module = parallelize(constraints)
            finally:
                codegen.apply_fsdp = fsdp
        for param in module.parameters():
            param.grad = None
        _per_use(module)
        runs["per_use"] = _step(module, tokens, targets)
        once, per_use = runs["once"], runs["per_use"]
        largest = max(float((once["grads"][name] - grad).abs().max()) for name, grad in per_use["grads"].items())
        results.append(dict(constraints=constraints, precision=module.plan.precision, loss=once["loss"],
                            per_use_loss=per_use["loss"], reference_loss=reference_loss,
                            num_microbatches=module.plan.num_microbatches, zero_stage=module.plan.zero_stage,
                            casts=once["casts"], per_use_casts=per_use["casts"],
                            num_fp32_weights=sum(1 for p in once["params"].values() if p.dtype == torch.float32),
                            same_grad_names=set(once["grads"]) == set(per_use["grads"]), largest_grad_diff=largest,
                            param_dtypes={str(p.dtype) for p in once["params"].values()},
                            grad_dtypes={str(g.dtype) for g in once["grads"].values()}))
    return results


def test_bf16_compute_keeps_fp32_weights_and_gradients_and_casts_once_per_step():
    """The step's bf16 copies (one cast per weight, FSDP2's MixedPrecisionPolicy under ZeRO-3) give
    the gradients a cast at every use gives, over every microbatch; the loss is the bf16 rounding
    torch.autocast gives on one device."""
    for rank_results in run_workers(bf16_worker, world_size=2, args=(tiny_model_cluster(2),)):
        for result in rank_results:
            label = result["constraints"]
            assert result["precision"] == "bf16"
            assert result["param_dtypes"] == {"torch.float32"} and result["grad_dtypes"] == {"torch.float32"}, label
            assert result["num_microbatches"] >= 2, label
            assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-2), label
            assert result["loss"] == pytest.approx(result["per_use_loss"], rel=1e-6), label
            assert result["same_grad_names"] and result["largest_grad_diff"] <= 1e-6, label
            if result["zero_stage"] == 3:  # the gathered parameters are bf16: nothing left to cast
                assert result["casts"] == 0, label
            else:  # each fp32 weight this rank uses, once; a cast per use costs one per microbatch at least
                assert 0 < result["casts"] <= result["num_fp32_weights"], label
                assert result["per_use_casts"] >= result["num_microbatches"] * result["casts"], label


FUSED_CONFIGS = ({"tp": 2, "microbatch_size": 4}, {"tp": 2, "microbatch_size": 4, "recompute": "op"},
                 {"dp": 2, "zero_stage": 0, "microbatch_size": 2},
                 {"pp": 2, "schedule": "1f1b", "microbatch_size": 2, "zero_stage": 0},
                 {"dp": 2, "zero_stage": 1, "microbatch_size": 1})
"""Column- and row-parallel DTensor linears, also under the "op" recomputation (selective
checkpoints of torch); ZeRO-0's all-reduce overlapped from post-accumulate hooks
(codegen/grad_overlap.py); pipeline stages accumulating over microbatches; ZeRO-1 on FSDP2 over 4
microbatches (into its fp32 unsharded gradients, reduce-scattered after the last)."""


def fused_worker(cluster: str) -> list[dict]:
    import os

    from torch.distributed.tensor import DTensor

    from autopar.models import build_model
    from one_process import parallelize_reusing_captures

    bundle = build_model(SPEC, device="cpu", seed=0, batch_size=8)
    tokens, targets = bundle.example_inputs[0], bundle.example_targets
    results = []
    for constraints in FUSED_CONFIGS:
        runs = {}
        for kernel in ("emulate", "off"):
            os.environ["AUTOPAR_FUSED_WGRAD"] = kernel  # read when the module is built
            try:
                module = parallelize_reusing_captures("mixed-precision", bundle.model, cluster, (tokens,),
                                                      loss_fn=bundle.loss_fn, example_targets=targets,
                                                      constraints=constraints, precision="bf16")
            finally:
                del os.environ["AUTOPAR_FUSED_WGRAD"]
            for _ in range(2):  # the second step runs ZeRO-0's overlapped reduction from the hooks
                for param in module.parameters():
                    param.grad = None
                runs[kernel] = _step(module, tokens, targets)
            runs[kernel]["stats"] = dict(module.stats.fused_wgrad)
        fused, plain = runs["emulate"], runs["off"]
        relative = max(float((fused["grads"][name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
                       for name, grad in plain["grads"].items())
        sharded = [p.grad for p in fused["params"].values() if isinstance(p.grad, DTensor)
                   and any(placement.is_shard() for placement in p.grad.placements)]
        results.append(dict(constraints=constraints, loss=fused["loss"], plain_loss=plain["loss"],
                            zero_stage=module.plan.zero_stage, num_microbatches=module.plan.num_microbatches,
                            num_sharded_grads=len(sharded), num_params=len(fused["params"]),
                            stats=fused["stats"], plain_stats=plain["stats"], largest_relative_diff=relative,
                            same_grad_names=set(fused["grads"]) == set(plain["grads"]),
                            grad_dtypes={str(g.dtype) for g in fused["grads"].values()}))
    return results


def test_weight_gradients_fused_into_the_fp32_grads_match_the_cast_and_add():
    """With the emulated fused kernel forced on (CPU has no out_dtype matmul), every linear on a
    step copy accumulates its weight gradient in fp32 inside the GEMM (none falls back): the loss
    is unchanged and the gradients are the cast-and-add path's up to its bf16 rounding of each
    microbatch's weight gradient (fp32 accumulation of the same bf16 products)."""
    for rank_results in run_workers(fused_worker, world_size=2, args=(tiny_model_cluster(2),)):
        for result in rank_results:
            label = result["constraints"]
            assert result["stats"].get("fused", 0) > 0 and result["stats"].get("fallback", 0) == 0, label
            assert result["plain_stats"] == {}, label
            assert result["loss"] == pytest.approx(result["plain_loss"], rel=1e-6), label
            assert result["same_grad_names"] and result["grad_dtypes"] == {"torch.float32"}, label
            assert result["largest_relative_diff"] <= 2e-2, label
            if result["zero_stage"] == 1:  # FSDP2 reduce-scattered the fused buffers into sharded fp32 grads
                assert result["num_microbatches"] >= 2, label
                assert result["num_sharded_grads"] == result["num_params"], label

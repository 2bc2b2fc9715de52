"""bf16 compute with fp32 master weights: the plan's precision policy on real process groups."""

from __future__ import annotations

import pytest

from harness import run_workers, tiny_model_cluster

pytestmark = pytest.mark.dist

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64,dropout=0.0"
CONFIGS = ({"tp": 2}, {"dp": 2, "zero_stage": 3})


def bf16_worker(cluster: str) -> list[dict]:
    import torch

    import autopar
    from autopar.models import build_model

    bundle = build_model(SPEC, device="cpu", seed=0, batch_size=8)
    reference = build_model(SPEC, device="cpu", seed=0, batch_size=8).model
    tokens, targets = bundle.example_inputs[0], bundle.example_targets
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference_loss = bundle.loss_fn(reference(tokens).float(), targets).item()
    results = []
    for constraints in CONFIGS:
        module = autopar.parallelize(bundle.model, cluster, (tokens,), loss_fn=bundle.loss_fn,
                                     example_targets=targets, constraints=constraints, precision="bf16")
        loss = module.train_step((tokens,), targets).item()
        params = list(module.parameters())
        results.append(dict(precision=module.plan.precision, loss=loss, reference_loss=reference_loss,
                            param_dtypes={str(p.dtype) for p in params},
                            grad_dtypes={str(p.grad.dtype) for p in params if p.grad is not None}))
    return results


def test_bf16_compute_keeps_fp32_weights_and_gradients():
    for rank_results in run_workers(bf16_worker, world_size=2, args=(tiny_model_cluster(2),)):
        for result in rank_results:
            assert result["precision"] == "bf16"
            assert result["param_dtypes"] == {"torch.float32"}
            assert result["grad_dtypes"] == {"torch.float32"}
            # bf16 rounding, as torch.autocast gives on one device.
            assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-2)

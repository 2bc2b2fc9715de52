"""ZeRO-3 under pipelining runs as planned: each FSDP unit resharded after its forward and after
every microbatch's backward (codegen's reshard_zero3_under_pipelining), so a rank holds at most the
unit it runs and the one FSDP prefetches, never its whole stage (torch's PipelineStage alone would
keep every unit gathered after each backward). Counted inside FSDP2 on 4 gloo ranks, pp=2 x dp=2."""

from __future__ import annotations

import pytest

from harness import run_workers

pytestmark = pytest.mark.dist

MODEL = "gpt:layers=8,hidden=64,heads=4,seq=16,vocab=64,dropout=0.0"
MICROBATCHES = 4


def _gathered_units_at_most() -> dict:
    """On one rank: its FSDP units and the most of them gathered at once during a training step."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp import FSDPModule

    import autopar
    from autopar.models import build_model

    bundle = build_model(MODEL, device="cpu", seed=0, batch_size=8)
    constraints = dict(pp=2, dp=2, tp=1, zero_stage=3, microbatch_size=8 // 2 // MICROBATCHES, schedule="1f1b")
    module = autopar.parallelize(bundle.model, "dgx-a100-80g:gpus_per_node=4", bundle.example_inputs,
                                 loss_fn=bundle.loss_fn, example_targets=bundle.example_targets, constraints=constraints)
    groups = [group for stage in module.stages for unit in stage.modules() if isinstance(unit, FSDPModule)
              for group in unit._get_fsdp_state()._fsdp_param_groups]
    most = {"gathered": 0}

    def counting(method):
        def wrapped(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            most["gathered"] = max(most["gathered"], sum(1 for group in groups if group.is_unsharded))
            return result
        return wrapped

    for name in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        setattr(param_group.FSDPParamGroup, name, counting(getattr(param_group.FSDPParamGroup, name)))
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    module.train_step((tokens,), (tokens + 1) % 64)
    return dict(units=len(groups), gathered=most["gathered"], microbatches=module.plan.num_microbatches)


def test_zero3_under_pipelining_holds_one_unit_and_its_prefetch_at_most():
    for result in run_workers(_gathered_units_at_most, 4, timeout_s=300):
        assert result["microbatches"] == MICROBATCHES
        assert result["units"] >= 4, result
        assert 1 <= result["gathered"] <= 2, result

"""Small plans shared by the report tests (one capture per test session)."""

from __future__ import annotations

from functools import lru_cache

from autopar import api

MODEL = "gpt:layers=8,hidden=64,heads=4,seq=32,vocab=128"
CLUSTER = "dgx-a100-80g:nodes=1"
GLOBAL_BATCH = 16


@lru_cache(maxsize=1)
def planner():
    return api.planner_for(MODEL, None, CLUSTER, global_batch=GLOBAL_BATCH)


@lru_cache(maxsize=None)
def evaluated(*, tp: int = 2, pp: int = 2, microbatch_size: int = 1, schedule: str = "1f1b",
              virtual_stages: int | None = None, recompute: str = "none", zero_stage: int = 0):
    """One fixed configuration, priced (a Plan)."""
    config = api.fixed_config(planner(), tp=tp, pp=pp, dp=None, microbatch_size=microbatch_size, schedule=schedule,
                              virtual_stages=virtual_stages, layers_per_virtual_stage=None, recompute=recompute,
                              zero_stage=zero_stage)
    return api.evaluate_with(planner(), config)


@lru_cache(maxsize=1)
def searched():
    """The searched plan, with its runners-up."""
    return api.plan_with(planner())

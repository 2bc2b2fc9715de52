"""The float8 linears' matmuls in the prepared segments' compute (solver/fp8_segments.py)."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.plans.planning import planner_for

SPEC = "gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=1024"


def every_linear(fqn: str, shape: tuple[int, ...]) -> bool:
    return True


def _planner(cluster: str = "dgx-h100:gpus_per_node=2", recipe: str = "tensorwise"):
    return planner_for(SPEC, None, cluster, global_batch=8, precision="fp8", fp8_filter=every_linear,
                       fp8_recipe=recipe)


def _config(planner, **settings):
    from autopar import api

    fixed = dict(tp=1, pp=1, dp=None, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                 layers_per_virtual_stage=None, recompute="none", zero_stage=0)
    return api.fixed_config(planner, **{**fixed, **settings})


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_blocks_compute_holds_their_float8_matmuls(recompute):
    """The blocks' segments run their linears' matmuls at the float8 time, the recomputed forward
    too under full recomputation; the segments without a float8 linear (the bf16 output head's)
    keep their bf16 time."""
    planner = _planner()
    config = _config(planner, recompute=recompute)
    bf16 = planner.pricing.prepared(config.tp, config.microbatch_size, recompute)
    fp8 = planner.pricing.prepared_for(config)
    blocks = [index for index, name in enumerate(fp8.names) if name.startswith("layers.")]
    others = [index for index in range(len(fp8.names)) if index not in blocks]
    assert blocks and all(fp8.forward_s[blocks] < bf16.forward_s[blocks])
    assert all(fp8.backward_s[blocks] < bf16.backward_s[blocks])
    assert all(fp8.weight_grad_s[blocks] < bf16.weight_grad_s[blocks])
    assert np.array_equal(fp8.forward_s[others], bf16.forward_s[others])
    forward_change = fp8.forward_s - bf16.forward_s
    assert np.allclose(fp8.recompute_s - bf16.recompute_s, forward_change if recompute == "full" else 0.0)
    assert np.allclose(fp8.time_s - bf16.time_s, forward_change + fp8.backward_s - bf16.backward_s
                       + fp8.recompute_s - bf16.recompute_s)
    assert planner.pricing.prepared_for(config) is fp8  # one per configuration key


def test_cpus_emulate_float8_so_their_segments_stay_bf16():
    planner = _planner("cpu:procs=2")
    config = _config(planner)
    assert planner.pricing.prepared_for(config).forward_s.tolist() == \
        planner.pricing.prepared(1, 1, "none").forward_s.tolist()


def test_float8_matmuls_leave_less_compute_to_hide_fsdps_collectives():
    """FSDP reduce-scatters each unit's gradients behind the backward of the units before it:
    shorter float8 matmuls hide less of them (two nodes, one GPU each: the gradients cross
    InfiniBand; the float8 all-gather changes the gathers' bytes, not the reduce-scatters')."""
    spec = "gpt:layers=2,hidden=2048,heads=16,seq=1024,vocab=1024"
    settings = dict(cluster="dgx-h100:nodes=2,gpus_per_node=1", global_batch=8, tp=1, pp=1, microbatch_size=1,
                    zero_stage=3)
    fp8 = autopar.evaluate(spec, precision="fp8", fp8_filter=every_linear, **settings).predicted.breakdown_s
    bf16 = autopar.evaluate(spec, precision="bf16", **settings).predicted.breakdown_s
    assert fp8["compute"] + fp8["fp8.matmul"] < bf16["compute"]
    assert fp8["dp.reduce_scatter"] > bf16["dp.reduce_scatter"] > 0


def test_float8_gemms_hide_less_of_the_tp_collectives_beside_them():
    """Under a runtime that overlaps tensor-parallel collectives with their GEMMs (Transformer
    Engine's userbuffers), the float8 linears' faster GEMMs cover less of each collective
    (tp_windows.py): the caps shrink, the collectives' own seconds stay."""
    from dataclasses import replace

    from autopar import api
    from autopar.cluster import Cluster
    from autopar.solver.fp8 import Fp8Choice, fp8_linears
    from autopar.solver.search import Planner
    from cost_model.memory import MEGATRON_BF16

    graph = autopar.capture_for_planning("llama:layers=2,hidden=2048,heads=16,kv_heads=4,ffn_hidden=8192,seq=2048,"
                                         "vocab=4096")
    planner = Planner(graph, Cluster.from_spec("dgx-h100:gpus_per_node=4"), global_batch=8,
                      policy=replace(MEGATRON_BF16, tp_comm_overlap=True), precision="fp8",
                      fp8=Fp8Choice(recipe="tensorwise", linears=fp8_linears(graph), handling="te"))
    config = api.fixed_config(planner, tp=4, pp=1, dp=1, microbatch_size=2, schedule="1f1b", virtual_stages=None,
                              layers_per_virtual_stage=None, recompute="none", zero_stage=0, cp=1,
                              sequence_parallel=True)
    bf16 = planner.pricing.prepared(config.tp, config.microbatch_size, "none", 1, True)
    fp8 = planner.pricing.prepared_for(config)
    for op in ("all_gather", "reduce_scatter"):
        assert fp8.overlap_caps_s[op].sum() < bf16.overlap_caps_s[op].sum()
        assert fp8.comm_by_op_s[op].tolist() == bf16.comm_by_op_s[op].tolist()

"""The GEMM beside which tensor-parallel overlap runs each collective (solver/tp_windows.py)."""

from __future__ import annotations

import numpy as np
import pytest

from autopar import api
from autopar.plans.planning import planner_for
from autopar.solver.costing import CommEvent
from autopar.solver.tp_windows import hideable_s, windowed, with_windows

PRODUCER = (("wo", 2.0),)
CONSUMERS = (("wq", 1.0), ("wk", 0.5))


def _event(op: str, phase: str, time_s: float = 4.0, copy_s: float = 0.0) -> CommEvent:
    return CommEvent(op=op, axis=0, message_bytes=1.0, time_s=time_s, phase=phase, copy_s=copy_s)


def test_a_gather_runs_beside_its_readers_gemms_and_a_scatter_beside_its_makers():
    """Forward all-gather and its gradient's reduce-scatter: the consumers' GEMMs; forward
    reduce-scatter and its gradient's all-gather: the producer's; other collectives get none."""
    events = [_event("all_gather", "fwd"), _event("reduce_scatter", "bwd"), _event("reduce_scatter", "fwd"),
              _event("all_gather", "bwd"), _event("all_reduce", "fwd")]
    windows = [event.window for event in with_windows(events, producer=PRODUCER, consumers=CONSUMERS)]
    assert windows == [CONSUMERS, CONSUMERS, PRODUCER, PRODUCER, None]


def test_what_a_window_covers_is_its_gemms_seconds_at_most_the_collectives():
    gather, scatter = with_windows([_event("all_gather", "fwd", copy_s=1.0), _event("reduce_scatter", "fwd")],
                                   producer=PRODUCER, consumers=CONSUMERS)
    assert windowed(gather) == ("all_gather", 3.0, CONSUMERS)
    assert hideable_s(windowed(gather)) == pytest.approx(1.5)
    assert hideable_s(windowed(scatter)) == pytest.approx(2.0)
    assert hideable_s(windowed(_event("all_gather", "fwd"))) == 4.0  # no window recorded: no cap
    assert hideable_s(windowed(gather), {"wq": 2.0}) == pytest.approx(1.0)  # a GEMM twice as fast hides half


LLAMA = "llama:layers=2,hidden=2048,heads=16,kv_heads=4,ffn_hidden=8192,seq=2048,vocab=4096"


def _prepared(precision: str):
    planner = planner_for(LLAMA, None, "dgx-h100:gpus_per_node=4", global_batch=8, precision=precision)
    config = api.fixed_config(planner, tp=4, pp=1, dp=1, microbatch_size=2, schedule="1f1b", virtual_stages=None,
                              layers_per_virtual_stage=None, recompute="none", zero_stage=0, cp=1,
                              sequence_parallel=True)
    return planner.pricing.prepared_for(config)


def test_grouped_query_attentions_gather_hides_behind_its_small_qkv_gemms_only():
    """A block's attention input all-gather runs beside q, k and v (small GEMMs on a grouped-query
    model), its MLP input's beside gate and up: the first can cover less than its seconds, the
    block's gathers together less than they take; the MLP's reduce-scatter (beside down) all."""
    prepared = _prepared("bf16")
    blocks = [index for index, name in enumerate(prepared.names) if name.startswith("layers.")]
    gathers, caps = prepared.comm_by_op_s["all_gather"][blocks], prepared.overlap_caps_s["all_gather"][blocks]
    assert np.all(caps < gathers) and np.all(caps > gathers / 2)
    records = [record for record in prepared.tp_windowed[blocks[0]] if record[0] == "all_gather"]
    assert any(hideable_s(record) < record[1] for record in records)
    assert any(hideable_s(record) == record[1] for record in records)


def test_faster_gemms_hide_less_of_the_same_collectives():
    """Float8 linears' GEMMs (solver/fp8_segments.py passes their speed-ups) cover less: the caps
    shrink where the windows bind, and nothing else of the segments' collectives changes."""
    bf16 = _prepared("bf16")
    nodes = {node for segment in bf16.tp_windowed for _, _, window in segment for node, _ in window or ()}
    zeros = np.zeros(len(bf16))
    fp8 = bf16.with_compute_change(zeros, zeros, zeros, zeros, gemm_speedups=dict.fromkeys(nodes, 2.0))
    for op in ("all_gather", "reduce_scatter"):
        assert fp8.overlap_caps_s[op].sum() < bf16.overlap_caps_s[op].sum()
    assert fp8.overlap_caps_s["all_reduce"].tolist() == bf16.overlap_caps_s["all_reduce"].tolist()
    assert {op: values.tolist() for op, values in fp8.comm_by_op_s.items()} == \
        {op: values.tolist() for op, values in bf16.comm_by_op_s.items()}


def test_torchs_fused_kernels_pay_their_own_passes_and_unfused_collectives_their_layout_copy():
    """Under overlap the intra-op ILP sees no copy; with_windows then gives a fused collective its
    kernel's own pass (the all-gather's shard into the symmetric buffer, the reduce-scatter's sum of
    tp partials: tp_overlap_passes) and one the runtime leaves unfused its layout copy: no GEMM
    beside it, or a summed gradient's reduce-scatter torch's kernels cannot take (tp_overlap_sums False)."""
    from dataclasses import replace

    from autopar.cluster import Cluster
    from autopar.graph import TensorMeta
    from autopar.mesh import Mesh
    from autopar.solver.sharding import cost_context
    from cost_model.memory import BF16_ADAM

    cluster = Cluster.from_spec("dgx-h100:gpus_per_node=4")
    meta = TensorMeta(shape=(2, 4096, 2048), dtype="bfloat16")
    policies = {name: replace(BF16_ADAM, tp_comm_overlap=overlap, tp_overlap_passes=passes)
                for name, overlap, passes in (("off", False, False), ("te", True, False), ("torch", True, True))}
    events = {name: {op: cost_context(Mesh(axis_names=("tp",), shape=(4,), devices_per_node=4), cluster, policy)
                      .redistribute(meta, source, target, "fwd")[0] for op, (source, target) in
                      (("all_gather", (("S1",), ("R",))), ("reduce_scatter", (("P",), ("S1",))))}
              for name, policy in policies.items()}
    for op in ("all_gather", "reduce_scatter"):
        dtensor, te, torch_ = events["off"][op], events["te"][op], events["torch"][op]
        assert dtensor.copy_s > 0 and dtensor.unfused_copy_s is None
        assert te.copy_s == torch_.copy_s == 0 and te.unfused_copy_s == torch_.unfused_copy_s == dtensor.copy_s
        assert te.fused_pass_s == 0 and 0 < torch_.fused_pass_s < dtensor.copy_s
        fused, = with_windows([torch_], producer=PRODUCER, consumers=CONSUMERS)
        assert fused.copy_s == torch_.fused_pass_s and fused.time_s == pytest.approx(torch_.time_s + fused.copy_s)
        unfused, = with_windows([torch_], producer=(), consumers=())
        assert unfused.copy_s == dtensor.copy_s and unfused.time_s == pytest.approx(dtensor.time_s)
        assert hideable_s(windowed(unfused)) == 0.0
    assert events["torch"]["all_gather"].fused_pass_s < events["torch"]["reduce_scatter"].fused_pass_s
    summed = replace(events["torch"]["reduce_scatter"], summed=True, phase="bwd")
    kept, = with_windows([summed], producer=PRODUCER, consumers=CONSUMERS, sums=False)
    assert kept.copy_s == events["off"]["reduce_scatter"].copy_s and kept.window == ()
    fused, = with_windows([summed], producer=PRODUCER, consumers=CONSUMERS, sums=True)
    assert fused.copy_s == summed.fused_pass_s and fused.window == CONSUMERS


def test_a_sequence_split_over_cp_ranks_halves_the_gemms_beside_each_collective():
    """Under context parallelism each rank's tp collectives carry its share of the tokens, and so do
    the GEMMs beside them (context_parallel._rescaled)."""
    planner = planner_for(LLAMA, None, "dgx-h100:gpus_per_node=8", global_batch=8, precision="bf16")
    whole, split = (planner.pricing.prepared(4, 2, "none", cp, True) for cp in (1, 2))
    block = next(index for index, name in enumerate(whole.names) if name.startswith("layers."))

    def windows(prepared):
        return [sum(seconds for _, seconds in window) for op, _, window in prepared.tp_windowed[block]
                if op == "all_gather" and window]

    assert windows(whole) and windows(split) == pytest.approx([seconds / 2 for seconds in windows(whole)])

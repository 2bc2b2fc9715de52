"""Tensor-parallel communication overlapped with the GEMMs (solver/tp_overlap.py), for runtimes
that run it so (PrecisionPolicy.tp_comm_overlap)."""

from dataclasses import replace

import pytest

import autopar
from autopar import api
from autopar.cluster import Cluster
from autopar.solver.search import Planner
from autopar.solver.tp_overlap import overlap_regather, overlap_tp_comm, overlappable
from cost_model.memory import MEGATRON_BF16

TERMS = {"all_gather": 0.4, "reduce_scatter": 0.4, "all_gather.regather": 0.2, "all_reduce": 0.1,
         "cp.send_recv": 0.05}


def test_only_the_sequence_parallel_collectives_are_overlapped() -> None:
    assert overlappable("all_gather") and overlappable("reduce_scatter") and overlappable("all_gather.regather")
    assert not overlappable("all_reduce") and not overlappable("all_to_all") and not overlappable("cp.send_recv")


def test_one_ring_step_of_tp_stays_exposed_and_the_rest_holds_sms() -> None:
    terms, change = overlap_tp_comm(TERMS, tp=4, compute_s=10.0, share=16 / 132)
    assert terms["all_gather"] == pytest.approx(0.1)
    assert terms["reduce_scatter"] == pytest.approx(0.1)
    assert terms["all_gather.regather"] == pytest.approx(0.05)
    assert terms["all_reduce"] == 0.1 and terms["cp.send_recv"] == 0.05
    hidden = 1.0 * 3 / 4
    assert terms["sm_contention"] == pytest.approx(hidden * 16 / 132)
    assert change == pytest.approx(-hidden + hidden * 16 / 132)


def test_more_tp_ranks_hide_more_of_each_collective() -> None:
    _, tp2 = overlap_tp_comm(TERMS, tp=2, compute_s=10.0, share=16 / 132)
    _, tp8 = overlap_tp_comm(TERMS, tp=8, compute_s=10.0, share=16 / 132)
    assert tp8 < tp2 < 0


def test_no_more_is_hidden_than_the_compute_it_runs_beside() -> None:
    terms, change = overlap_tp_comm(TERMS, tp=8, compute_s=0.1, share=0.0)
    assert change == pytest.approx(-0.1)
    assert sum(terms[op] for op in TERMS if overlappable(op)) == pytest.approx(1.0 - 0.1)


def test_a_regather_beside_the_input_gradient_gemms_is_hidden_up_to_them() -> None:
    """Megatron-LM's and Transformer Engine's backward all-gather of a kept shard runs beside the
    dgrad GEMM: hidden while the stage's backward lasts, holding its SMs; nothing else moves."""
    terms, change = overlap_regather(TERMS, backward_s=10.0, share=16 / 132)
    assert terms["all_gather.regather"] == 0.0 and terms["all_gather"] == TERMS["all_gather"]
    assert terms["sm_contention"] == pytest.approx(0.2 * 16 / 132)
    assert change == pytest.approx(-0.2 + 0.2 * 16 / 132)
    short, _ = overlap_regather(TERMS, backward_s=0.05, share=0.0)
    assert short["all_gather.regather"] == pytest.approx(0.15)


def test_a_collective_hides_no_more_than_its_own_gemm() -> None:
    """`caps_s`: of each term, the seconds its collectives' GEMMs can cover (tp_windows.py); the
    ring's (tp - 1) / tp of those is hidden, the stage's compute notwithstanding."""
    terms, change = overlap_tp_comm(TERMS, tp=4, compute_s=10.0, share=0.0, caps_s={"all_gather": 0.2})
    assert terms["all_gather"] == pytest.approx(0.4 - 0.2 * 3 / 4)
    assert terms["reduce_scatter"] == pytest.approx(0.1)
    assert change == pytest.approx(-(0.2 + 0.4 + 0.2) * 3 / 4)


def test_without_tp_nothing_changes() -> None:
    assert overlap_tp_comm(TERMS, tp=1, compute_s=1.0, share=16 / 132) == (TERMS, 0.0)


GPT = "gpt:layers=4,hidden=2048,heads=16,vocab=4096,seq=2048"


@pytest.fixture(scope="module")
def graph():
    return autopar.capture_for_planning(GPT)


def _estimate(graph, policy, recompute: str = "none"):
    planner = Planner(graph, Cluster.from_spec("dgx-h100:nodes=1"), global_batch=8, policy=policy, precision="bf16")
    config = api.fixed_config(planner, tp=4, pp=1, dp=2, microbatch_size=1, schedule="1f1b",
                                      virtual_stages=None, layers_per_virtual_stage=None, recompute=recompute,
                                      zero_stage=1, cp=1, sequence_parallel=True)
    return planner.evaluate(config)[0]


def test_a_runtime_that_overlaps_its_tp_comm_is_priced_faster_with_its_sm_share(graph) -> None:
    exposed = _estimate(graph, MEGATRON_BF16)
    overlapped = _estimate(graph, replace(MEGATRON_BF16, tp_comm_overlap=True))
    assert overlapped.step_time_s < exposed.step_time_s
    # 3/4 of each gather hidden at most; less where its GEMM is shorter (solver/tp_windows.py)
    assert exposed.breakdown_s["tp.all_gather"] / 4 <= overlapped.breakdown_s["tp.all_gather"] \
        < exposed.breakdown_s["tp.all_gather"] / 2
    assert overlapped.breakdown_s["tp.sm_contention"] > 0
    assert "tp.sm_contention" not in exposed.breakdown_s


def test_async_tp_leaves_the_reduce_scatter_of_a_summed_gradient_exposed() -> None:
    terms = {**TERMS, "reduce_scatter.summed": 0.3}
    assert overlappable("reduce_scatter.summed") and not overlappable("reduce_scatter.summed", sums=False)
    te, _ = overlap_tp_comm(terms, tp=4, compute_s=10.0, share=0.0)
    torch_async, change = overlap_tp_comm(terms, tp=4, compute_s=10.0, share=0.0, sums=False)
    assert te["reduce_scatter.summed"] == pytest.approx(0.3 / 4)
    assert torch_async["reduce_scatter.summed"] == 0.3 and torch_async["reduce_scatter"] == pytest.approx(0.1)
    assert change == pytest.approx(-1.0 * 3 / 4)


def test_a_gradient_summed_over_the_readers_of_one_gathered_input_is_reduce_scattered_summed(graph) -> None:
    policy = replace(MEGATRON_BF16, tp_comm_overlap=True)
    te = _estimate(graph, policy)
    torch_async = _estimate(graph, replace(policy, tp_overlap_sums=False))
    exposed = _estimate(graph, MEGATRON_BF16)
    assert exposed.breakdown_s["tp.reduce_scatter.summed"] > 0
    assert te.breakdown_s["tp.reduce_scatter.summed"] == pytest.approx(exposed.breakdown_s["tp.reduce_scatter.summed"] / 4)
    assert torch_async.breakdown_s["tp.reduce_scatter.summed"] == pytest.approx(
        exposed.breakdown_s["tp.reduce_scatter.summed"])
    assert te.step_time_s < torch_async.step_time_s < exposed.step_time_s


def test_megatrons_regathers_run_beside_its_dgrad_gemms(graph) -> None:
    """Keeping the gathered inputs as shards ("gathers"), Megatron's runtime hides the backward
    re-gathers (MEGATRON_BF16.regather_overlap); a runtime that redistributes them leaves them exposed."""
    hidden = _estimate(graph, MEGATRON_BF16, "gathers")
    exposed = _estimate(graph, replace(MEGATRON_BF16, regather_overlap=False), "gathers")
    assert exposed.breakdown_s["tp.all_gather.regather"] > 0
    assert hidden.breakdown_s.get("tp.all_gather.regather", 0.0) == 0.0
    assert hidden.step_time_s < exposed.step_time_s

"""Pipeline sends overlapped with compute in an interleaved schedule's steady state
(solver/p2p_overlap.py), for runtimes that run them so (PrecisionPolicy.p2p_overlap)."""

from dataclasses import replace

import pytest

import autopar
from autopar import api
from autopar.cluster import Cluster
from autopar.solver.p2p_overlap import hidden_p2p_s
from autopar.solver.search import Planner
from cost_model.memory import MEGATRON_BF16


def test_the_interleaved_steady_state_hides_its_sends_up_to_its_compute() -> None:
    assert hidden_p2p_s(0.2, compute_s=5.0, schedule="interleaved", num_stages=4) == pytest.approx(0.2)
    assert hidden_p2p_s(0.2, compute_s=0.05, schedule="interleaved", num_stages=4) == pytest.approx(0.05)


def test_other_schedules_and_no_pipeline_hide_nothing() -> None:
    for schedule in ("1f1b", "gpipe", "zb1p", "zbv"):
        assert hidden_p2p_s(0.2, compute_s=5.0, schedule=schedule, num_stages=4) == 0.0
    assert hidden_p2p_s(0.2, compute_s=5.0, schedule="interleaved", num_stages=1) == 0.0


GPT = "gpt:layers=8,hidden=1024,heads=16,vocab=4096,seq=1024"


@pytest.fixture(scope="module")
def graph():
    return autopar.capture_for_planning(GPT)


def _estimate(graph, policy, schedule):
    planner = Planner(graph, Cluster.from_spec("dgx-h100:nodes=2"), global_batch=16, policy=policy, precision="bf16")
    config = api.fixed_config(planner, tp=1, pp=4, dp=4, microbatch_size=1, schedule=schedule,
                              virtual_stages=2 if schedule == "interleaved" else None, layers_per_virtual_stage=None,
                              recompute="none", zero_stage=1, cp=1, sequence_parallel=True)
    return planner.evaluate(config)[0]


def test_an_overlapping_runtime_keeps_only_the_fill_and_flush_sends(graph) -> None:
    waited = _estimate(graph, MEGATRON_BF16, "interleaved")
    overlapped = _estimate(graph, replace(MEGATRON_BF16, p2p_overlap=True), "interleaved")
    assert waited.breakdown_s["pp.send_recv"] > 0
    assert overlapped.breakdown_s["pp.send_recv"] == pytest.approx(0.0, abs=1e-12)
    hidden = waited.breakdown_s["pp.send_recv"]
    assert overlapped.step_time_s == pytest.approx(waited.step_time_s - hidden)
    assert overlapped.breakdown_s["bubble"] == pytest.approx(waited.breakdown_s["bubble"])


def test_a_1f1b_pipeline_waits_on_its_sends_under_either_policy(graph) -> None:
    waited = _estimate(graph, MEGATRON_BF16, "1f1b")
    overlapped = _estimate(graph, replace(MEGATRON_BF16, p2p_overlap=True), "1f1b")
    assert overlapped.step_time_s == pytest.approx(waited.step_time_s)

"""Optimizer offload (FSDP2 CPUOffloadPolicy): priced with the host link and the CPU Adam step,
chosen only when nothing fits without it."""

from dataclasses import replace

import pytest

from autopar import api
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.plans.plan import Plan
from autopar.solver.constraints import Constraints
from autopar.solver.search import SearchOptions
from autopar.solver.step_model import ParallelConfig, PreparedSegments
from cost_model.allocator import NO_OVERHEAD
from cost_model.hardware import SYSTEMS
from test_step_model import model, segments

MODEL = "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1024"


def _cluster_file(tmp_path, memory_gib: float):
    path = tmp_path / f"one_gpu_{memory_gib}.toml"
    path.write_text(f'preset = "dgx-a100-80g"\nnodes = 1\ngpus_per_node = 1\n[device]\nmemory_gib = {memory_gib}\n')
    return str(path)


def _plan(tmp_path, memory_gib: float, **constraints) -> Plan:
    # No CUDA context or allocator terms: the test is about model states against a small budget.
    planner = api.planner_for(MODEL, None, _cluster_file(tmp_path, memory_gib), global_batch=2,
                              options=SearchOptions(allocator=NO_OVERHEAD))
    return api.plan_with(planner, Constraints(**constraints))


def test_a_model_that_fits_is_not_offloaded(tmp_path):
    plan = _plan(tmp_path, 80)
    assert not plan.offload
    assert not plan.predicted.host_memory_bytes
    assert not any(term.startswith("offload.") for term in plan.predicted.breakdown_s)


def test_a_model_that_does_not_fit_is_offloaded(tmp_path):
    memory_gib = 0.03  # parameters, gradients and Adam states alone need ~0.05 GiB
    with pytest.raises(InfeasiblePlanError):
        _plan(tmp_path, memory_gib, offload=False)
    plan = _plan(tmp_path, memory_gib)
    assert plan.offload and plan.zero_stage == 3 and plan.mesh["pp"] == 1
    device, host = plan.predicted.memory_bytes, plan.predicted.host_memory_bytes
    assert device["parameters"] == device["gradients"] == device["optimizer"] == 0
    assert host["host.optimizer"] > host["host.parameters"] > 0
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_budget_bytes
    breakdown = plan.predicted.breakdown_s
    assert breakdown["offload.cpu_adam"] > 0 and breakdown["optimizer"] == 0
    assert "offload.h2d" in breakdown and "offload.d2h" in breakdown
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "optimizer offload" in plan.summary() and "host memory" in plan.summary()


def test_a_pipelined_constraint_that_fits_nowhere_says_what_the_leanest_needs(tmp_path):
    """With pp > 1 the offload pass (pp = 1 only) prices nothing; the refusal still names the
    leanest configuration of the pass that priced some, not an empty search."""
    path = tmp_path / "two_gpus.toml"
    path.write_text('preset = "dgx-a100-80g"\nnodes = 1\ngpus_per_node = 2\n[device]\nmemory_gib = 0.03\n')
    planner = api.planner_for(MODEL, None, str(path), global_batch=2, options=SearchOptions(allocator=NO_OVERHEAD))
    with pytest.raises(InfeasiblePlanError, match=r"does not fit: the leanest configuration found \(dp=1 tp=1 pp=2"):
        api.plan_with(planner, Constraints(pp=2, tp=1))


def test_when_only_host_memory_is_short_the_refusal_says_so(tmp_path):
    """Offloaded, the states fit the device but not the host: the message names host memory,
    not a device peak that fits."""
    path = tmp_path / "small_host.toml"
    path.write_text('preset = "dgx-a100-80g"\nnodes = 1\ngpus_per_node = 1\n[device]\nmemory_gib = 0.03\n'
                    'host_memory_gib = 0.001\n')
    planner = api.planner_for(MODEL, None, str(path), global_batch=2, options=SearchOptions(allocator=NO_OVERHEAD))
    with pytest.raises(InfeasiblePlanError) as refused:
        api.plan_with(planner, Constraints())
    message = " ".join(str(refused.value).split())
    assert "offload" in message and "which fits" in message and "of host memory per device" in message
    assert "host.optimizer" in message and "1.02 MiB the cluster's nodes have per device" in message  # 0.001 GiB


def _offloaded(dp: int = 2, num_microbatches: int = 1, **step_model_changes):
    config = ParallelConfig(dp=dp, tp=1, pp=1, microbatch_size=1, num_microbatches=num_microbatches,
                            zero_stage=3, offload=True)
    step_model = model()
    spec = SYSTEMS["dgx-a100-80g"].device
    host = dict(host_link_bytes_per_s=spec.host_link_bytes_per_s,
                host_memory_bandwidth_bytes_per_s=spec.host_memory_bandwidth_bytes_per_s,
                host_memory_bytes=spec.host_memory_bytes)
    step_model = replace(step_model, **{**host, **step_model_changes})
    return step_model.estimate(PreparedSegments.build(segments(), "none"), config), step_model


def test_cpu_adam_steps_the_shard_at_host_memory_bandwidth():
    result, step_model = _offloaded(dp=2)
    numel = 8 * 1e6 / 2  # this device's shard
    assert result.breakdown_s["offload.cpu_adam"] == pytest.approx(
        numel * step_model.optimizer_io_bytes_per_param / (409.6e9 / 8))
    assert result.host_memory_bytes["host.optimizer"] == pytest.approx(numel * 12)


def test_host_copies_are_exposed_when_the_link_is_slow():
    fast, _ = _offloaded()
    slow, step_model = _offloaded(host_link_bytes_per_s=1e6)
    copies_s = 8 * (1e6 / 2) * 4 / 1e6  # every unit's shard, fp32, one way
    assert fast.breakdown_s["offload.h2d"] < 1e-3 < slow.breakdown_s["offload.h2d"]
    # the forward and backward gathers each wait for their copy; compute hides at most its own length
    hidden_at_most = 8 * (0.01 + 0.02)
    assert slow.breakdown_s["offload.h2d"] >= 2 * copies_s - hidden_at_most
    # from the second microbatch the gradient copy blocks: (m - 1) of m copies are exposed
    accumulated, _ = _offloaded(num_microbatches=4, host_link_bytes_per_s=1e6)
    assert accumulated.breakdown_s["offload.d2h"] >= 3 * copies_s
    assert accumulated.breakdown_s["offload.grad_accumulate"] > 0


def test_offload_needs_zero_3_and_no_pipeline(tmp_path):
    planner = api.planner_for(MODEL, None, _cluster_file(tmp_path, 80), global_batch=2)
    with pytest.raises(ConfigError, match="ZeRO-3"):
        api.fixed_config(planner, tp=1, pp=1, dp=1, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                         layers_per_virtual_stage=None, recompute="none", zero_stage=1, offload=True)
    with pytest.raises(ConfigError, match="True or False"):
        api.plan(MODEL, cluster=_cluster_file(tmp_path, 80), global_batch=2, constraints={"offload": "yes"})

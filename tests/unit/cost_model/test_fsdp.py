"""FSDP2's per-unit overlap (cost_model/fsdp.py) against closed forms, and the allocator terms."""

import pytest

from cost_model.allocator import AllocatorModel
from cost_model.fsdp import FsdpUnit, copy_bytes, fsdp_timeline, unsharded_bytes
from cost_model.memory import BF16_ADAM, FSDP2_BF16_FP32_REDUCE

F, B = 0.010, 0.020


def units(count: int, gather_s: float, scatter_s: float) -> list[FsdpUnit]:
    return [FsdpUnit(forward_s=F, backward_s=B, all_gather_s=gather_s, reduce_scatter_s=scatter_s)] * count


def test_hidden_communication_exposes_only_the_ends():
    """Gathers shorter than a unit's forward, gather + reduce-scatter shorter than its backward:
    only the first forward gather, the last unit's backward re-gather and the last reduce-scatter
    are exposed."""
    gather, scatter = 0.004, 0.006
    timeline = fsdp_timeline(units(8, gather, scatter), reshard_after_forward=True)
    assert timeline.forward_gather_exposed_s == pytest.approx(gather)
    assert timeline.backward_exposed_s == pytest.approx(gather + scatter)
    assert timeline.gather_s == pytest.approx(2 * 8 * gather)
    assert timeline.reduce_scatter_s == pytest.approx(8 * scatter)


def test_gather_bound_forward_runs_at_the_gather_rate():
    """G > F: gathers run back to back, forward ends at n G + F, so n (G - F) + F is exposed."""
    gather, count = 0.025, 6
    timeline = fsdp_timeline(units(count, gather, 0.0), reshard_after_forward=True, reduce_scatter=False)
    assert timeline.forward_gather_exposed_s == pytest.approx(count * (gather - F) + F)
    # Backward: the last unit's gather, then each earlier one queued as its successor starts:
    # B < G, so backward ends at n G + B after the forward end.
    assert timeline.backward_exposed_s == pytest.approx(count * gather + B - count * B)
    assert timeline.worst_unit_ratio == pytest.approx(2 * gather / (F + B))


def test_without_resharding_backward_needs_no_gathers():
    timeline = fsdp_timeline(units(4, 0.004, 0.0), reshard_after_forward=False, reduce_scatter=False)
    assert timeline.exposed_s == pytest.approx(0.004)
    assert timeline.gather_s == pytest.approx(4 * 0.004)


def test_reduce_scatters_longer_than_backward_pile_up():
    """R > B with no gathers in backward: reduce-scatters queue back to back after the first
    backward, so the step waits B + n R - n B for them."""
    scatter, count = 0.03, 5
    timeline = fsdp_timeline(units(count, 0.0, scatter), reshard_after_forward=False)
    assert timeline.backward_exposed_s == pytest.approx(B + count * scatter - count * B)


def test_unsharded_bytes_are_two_units_of_parameters_and_one_of_gradients():
    assert unsharded_bytes([1e6, 3e6, 2e6], param_bytes=2, grad_bytes=4) == pytest.approx(5e6 * 2 + 3e6 * 4)
    assert unsharded_bytes([7.0], param_bytes=2, grad_bytes=2) == pytest.approx(28.0)
    assert unsharded_bytes([], param_bytes=2, grad_bytes=2) == 0.0


def test_allocator_terms():
    allocator = AllocatorModel(cuda_context_bytes=100.0, nccl_bytes_per_communicator=10.0, fragmentation_fraction=0.1)
    assert allocator.context_bytes(3) == pytest.approx(130.0)
    assert allocator.fragmentation_bytes(1000.0) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        AllocatorModel(fragmentation_fraction=-0.1)


def test_copies_read_and_write_every_gathered_element_and_cast_gradients_to_the_reduce_dtype():
    copy_out, copy_in = copy_bytes(1e6, gather_bytes=2.0, reduce_bytes=4.0)
    assert copy_out == 2 * 2.0 * 1e6  # gathered bf16 buffer read, unsharded parameters written
    assert copy_in == (2.0 + 4.0) * 1e6  # bf16 gradients read, fp32 reduce-scatter input written


@pytest.mark.parametrize("zero_stage, num_microbatches", [(3, 1), (3, 4), (2, 4), (1, 4)])
@pytest.mark.parametrize("policy", [FSDP2_BF16_FP32_REDUCE, BF16_ADAM], ids=["torchtitan", "autopar"])
def test_fsdp_copies_are_priced_on_the_compute_stream(zero_stage, num_microbatches, policy):
    """FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter. Under
    autopar's own runtime (BF16_ADAM) each microbatch's copy-in is the gradients' cast to fp32,
    which the segments' backward already prices (evaluate._add_gradient_cast): not counted twice."""
    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments

    step_model = model(policy=policy)
    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=num_microbatches,
                            zero_stage=zero_stage)
    result = step_model.estimate(PreparedSegments.build(segments(), "none"), config)
    numel = 8 * 1e6  # the stage's unsharded parameters (segments(): 8 units of 1e6)
    bandwidth = step_model.compute.bandwidth_bytes_per_s
    policy = step_model.policy
    copy_out_s = 2 * numel * policy.fsdp_gather_bytes / bandwidth
    copy_in_s = numel * (policy.fsdp_gather_bytes + policy.dp_reduce_bytes) / bandwidth
    breakdown = result.breakdown_s
    m = num_microbatches
    if zero_stage == 3:  # gathered before the forward and again before the backward, every microbatch
        assert breakdown["dp.copy_out"] == pytest.approx(2 * m * copy_out_s)
    else:  # kept gathered from the first forward to the last backward: once
        assert breakdown["dp.copy_out.once"] == pytest.approx(copy_out_s)
    if zero_stage >= 2 and policy.casts_once_per_step:
        assert "dp.copy_in" not in breakdown and "dp.copy_in.once" not in breakdown
    elif zero_stage >= 2:  # reduce-scattered every microbatch
        assert breakdown["dp.copy_in"] == pytest.approx(m * copy_in_s)
    else:
        assert breakdown["dp.copy_in.once"] == pytest.approx(copy_in_s)
    unsharded = step_model.estimate(PreparedSegments.build(segments(), "none"),
                                    ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1,
                                                   num_microbatches=num_microbatches, zero_stage=0))
    assert not any(term.startswith("dp.copy") for term in unsharded.breakdown_s)  # DDP: no FSDP copies

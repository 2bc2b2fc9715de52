"""FSDP2's per-unit overlap (cost_model/fsdp.py) against closed forms, and the allocator terms."""

import pytest

from cost_model.allocator import AllocatorModel
from cost_model.fsdp import (FsdpUnit, copy_bytes, ends_fit_a_block, fsdp_timeline, root_ends, timelines_of_arrays,
                             unsharded_bytes)

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


def test_root_ends_gather_the_first_and_last_units_together_once_and_keep_the_last_block():
    forward, backward, scatters = root_ends([1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0])
    assert forward == [6.0, 2.0, 3.0, 4.0, 0.0]  # the root's gather before the first unit
    assert backward == [0.0, 2.0, 3.0, 0.0, 0.0]  # root kept (FSDP2's root), last block kept (torchtitan)
    assert scatters == [60.0, 20.0, 30.0, 40.0, 0.0]  # the root's reduce-scatter after the last backward
    assert root_ends([1.0, 2.0], [3.0, 4.0]) == ([1.0, 2.0], [1.0, 2.0], [3.0, 4.0])


def test_root_ends_expose_the_roots_gather_and_reduce_scatter_whole():
    """Hidden communication, n identical units: the root's gather (2 G) before the first forward
    and its reduce-scatter (2 R) after the last backward are exposed; nothing is gathered for the
    first backward (the root and the last block are kept), so no gather is exposed there."""
    gather, scatter, count = 0.004, 0.006, 8
    forward, backward, scatters = root_ends([gather] * count, [scatter] * count)
    timeline, gathers_only = timelines_of_arrays([F] * count, [B] * count, forward, scatters,
                                                 reshard_after_forward=True, backward_gather_s=backward)
    assert timeline.forward_gather_exposed_s == pytest.approx(2 * gather)
    assert timeline.backward_exposed_s == pytest.approx(2 * scatter)
    assert gathers_only == pytest.approx(2 * gather)
    assert timeline.gather_s == pytest.approx((count + count - 3) * gather)
    assert timeline.reduce_scatter_s == pytest.approx(count * scatter)


def test_root_ends_hold_the_root_and_the_heads_gradients_beside_a_pair_of_blocks():
    sizes = [5e6, 1e6, 2e6, 1e6, 7e6]
    held = unsharded_bytes(sizes, param_bytes=2, grad_bytes=4, root_ends=True, held_grad_bytes=2)
    assert held == pytest.approx((5e6 + 7e6 + 3e6) * 2 + 7e6 * 2 + 2e6 * 4)
    assert unsharded_bytes(sizes[:2], param_bytes=2, grad_bytes=4, root_ends=True) == \
        unsharded_bytes(sizes[:2], param_bytes=2, grad_bytes=4)


def test_ends_fit_a_block_when_together_no_larger_than_the_largest_block():
    assert ends_fit_a_block([1.0, 5.0, 5.0, 4.0])
    assert not ends_fit_a_block([3.0, 5.0, 5.0, 3.0])
    assert not ends_fit_a_block([0.0, 0.0])  # no block between them

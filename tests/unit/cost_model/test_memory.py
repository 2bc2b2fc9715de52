import pytest

from cost_model.memory import (BF16_ADAM, activation_memory, chunk_microbatches_in_flight, microbatches_in_flight,
                               model_state_memory)


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, expected_gb):
    # ZeRO (arXiv 1910.02054) Figure 1: 7.5B parameters, data parallel 64, K = 12.
    memory = model_state_memory(7.5e9, dp=64, zero_stage=stage, policy=BF16_ADAM)
    assert memory.total_bytes / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_zero_breakdown_by_state():
    memory = model_state_memory(1e9, dp=8, zero_stage=2)
    assert memory.params_bytes == 2e9
    assert memory.grads_bytes == pytest.approx(2e9 / 8)
    assert memory.optimizer_bytes == pytest.approx(12e9 / 8)


def test_bad_zero_arguments():
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_memory(1, dp=1, zero_stage=4)
    with pytest.raises(ValueError, match="dp"):
        model_state_memory(1, dp=0, zero_stage=0)


def test_in_flight_microbatches_per_schedule():
    # 1F1B: stage i of p holds p - i microbatches (at most m); GPipe holds all m.
    assert [microbatches_in_flight("1f1b", stage=i, num_stages=4, num_microbatches=8) for i in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight("1f1b", stage=0, num_stages=4, num_microbatches=2) == 2
    assert microbatches_in_flight("gpipe", stage=3, num_stages=4, num_microbatches=8) == 8
    # Interleaved with v chunks: the first stage holds p(1 + (p-1)/(p v)) stage-equivalents (Korthikanti et al.).
    p, v = 8, 4
    assert microbatches_in_flight("interleaved", stage=0, num_stages=p, num_microbatches=64,
                                  virtual_stages=v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert activation_memory(10.0, schedule="1f1b", stage=0, num_stages=2, num_microbatches=4) == 20.0
    with pytest.raises(ValueError, match="unknown schedule"):
        microbatches_in_flight("zigzag", stage=0, num_stages=2, num_microbatches=2)


def test_interleaved_chunks_are_held_in_the_schedules_order():
    """Per chunk: the rank's total as above, split as the schedule runs them. The last rank runs
    each forward of its last chunk (the output layer) just before that microbatch's backward."""
    p, v, m = 4, 3, 8

    def held(rank):
        return [chunk_microbatches_in_flight("interleaved", rank=rank, chunk=c, num_stages=p, num_microbatches=m,
                                             virtual_stages=v) for c in range(v)]

    for rank in range(p):
        assert sum(held(rank)) == pytest.approx(v * microbatches_in_flight(
            "interleaved", stage=rank, num_stages=p, num_microbatches=m, virtual_stages=v))
    assert held(p - 1) == [4, 4, 1]  # warmup (v - 1) p = 8 forwards: chunks 0 and 1, p each
    assert held(0) == [7, 4, 4]  # warmup (v - 1) p + 2 (p - 1) = 14 forwards, the 15th of chunk 0 again
    # all m v forwards fit in rank 0's warmup: every microbatch of every chunk held
    assert [chunk_microbatches_in_flight("interleaved", rank=0, chunk=c, num_stages=p, num_microbatches=p,
                                         virtual_stages=v) for c in range(v)] == [p] * v


def test_accumulated_gradients_are_not_held_before_the_first_backward():
    """Gradients accumulated unsharded until the step's reduce-scatter (FSDP under pipelining)
    exist from a chunk's first backward; a rank holding every microbatch before its first
    backward has none at that moment, then each backward frees a microbatch as it fills a chunk."""
    from cost_model.memory import accumulated_gradient_peak

    def peak(schedule, rank, p, m, activations, gradients):
        return accumulated_gradient_peak(schedule, rank=rank, num_stages=p, num_microbatches=m,
                                         virtual_stages=len(activations), chunk_activation_bytes=activations,
                                         chunk_gradient_bytes=gradients)

    # GPipe holds all m first: the peak is theirs while a microbatch outweighs the gradients ...
    assert peak("gpipe", 0, 4, 4, (10.0,), (5.0,)) == (40.0, 0.0)
    # ... and m - 1 microbatches with the gradients where these weigh more.
    assert peak("gpipe", 0, 4, 4, (10.0,), (15.0,)) == (30.0, 15.0)
    # 1F1B with more microbatches than it holds: the steady state holds p - rank with the gradients.
    assert peak("1f1b", 0, 4, 8, (10.0,), (5.0,)) == (40.0, 5.0)
    assert peak("1f1b", 2, 4, 8, (10.0,), (5.0,)) == (20.0, 5.0)
    # Interleaved, m = p: every chunk's microbatches are held before the first backward (of the
    # last chunk), whose gradients the peak then carries, one microbatch of that chunk freed.
    assert peak("interleaved", 1, 4, 4, (1.0, 2.0), (3.0, 4.0)) == (4 * 3.0 - 2.0, 4.0)
    assert peak("zbv", 0, 4, 8, (1.0, 1.0), (1.0, 1.0)) is None  # deferred W passes: gradients whole
    with pytest.raises(ValueError, match="per local chunk"):
        accumulated_gradient_peak("interleaved", rank=0, num_stages=2, num_microbatches=2, virtual_stages=2,
                                  chunk_activation_bytes=(1.0,), chunk_gradient_bytes=(1.0,))


def test_a_policy_names_one_of_the_known_layout_copy_behaviours():
    from cost_model.memory import MEGATRON_BF16, PrecisionPolicy

    assert PrecisionPolicy().sp_layout_copies == "batched_gathers" and MEGATRON_BF16.sp_layout_copies == "none"
    with pytest.raises(ValueError, match="sp_layout_copies 'always' is not one of batched_gathers, all, none"):
        PrecisionPolicy(sp_layout_copies="always")

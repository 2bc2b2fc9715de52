"""The pipeline's time from its stage times, and what each pipeline rank holds (solver/pipeline_time.py)."""

import pytest

from autopar.solver.configs import ParallelConfig
from autopar.solver.pipeline_time import StageTimes, chunks_in_flight, own_stages, pipeline_bound_s, pipeline_time_s


def _config(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> ParallelConfig:
    return ParallelConfig(dp=1, tp=1, pp=pp, microbatch_size=1, num_microbatches=microbatches, schedule=schedule,
                          virtual_stages=virtual_stages)


def _stage(seconds: float, hidden_s: float = 0.0) -> StageTimes:
    return StageTimes(time_per_microbatch_s=seconds, forward_pass_s=seconds / 3, weight_grad_s=seconds / 3,
                      p2p_hidden_s=hidden_s)


def test_1f1b_runs_m_minus_one_slowest_stages_and_one_of_each():
    stages = [_stage(1.0), _stage(2.0), _stage(1.5), _stage(1.0)]
    assert pipeline_time_s(_config(4, 8), stages, stages[1]) == pytest.approx(7 * 2.0 + 5.5)
    assert pipeline_bound_s(_config(4, 8), stages) == pytest.approx(7 * 2.0 + 5.5)


def test_interleaving_shrinks_the_fill_and_flush_which_wait_for_the_hidden_sends():
    stages = [_stage(2.0, hidden_s=0.1)] * 4
    plain = pipeline_time_s(_config(4, 8, "interleaved", 2), stages, stages[0])
    assert plain == pytest.approx(8 * 2.0 + 3 / 2 * (2.0 + 0.1))
    assert pipeline_time_s(_config(1, 8), stages[:1], stages[0]) == pytest.approx(16.0)  # no pipeline: m x t


def test_each_rank_holds_its_chunks_and_the_first_holds_the_most_microbatches_under_1f1b():
    config = _config(4, 8, "interleaved", 2)
    assert own_stages(config, 1) == (1, 5)  # rank r holds chunks r and r + pp
    flights = chunks_in_flight(_config(4, 8))
    assert flights[0] == 4 and flights[-1] == 1  # 1F1B: the first stage holds pp microbatches, the last one

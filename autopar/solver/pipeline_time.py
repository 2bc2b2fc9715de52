"""The pipeline part of a step (solver/step_model.py prices the stages): its time T from the
stage times under each schedule (the step model's docstring gives the closed forms), and which
model chunks and how many microbatches each pipeline rank holds."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from autopar.solver.configs import ParallelConfig, StageEstimate
from autopar.solver.pipeline import rank_of, stages_of_rank
from autopar.solver.schedule_sim import uniform_bubble_s
from cost_model.memory import chunk_microbatches_in_flight


class StageTimes(NamedTuple):
    """What pipeline_time_s reads of a stage (StageEstimate's fields of the same names)."""

    time_per_microbatch_s: float
    forward_pass_s: float
    weight_grad_s: float
    p2p_hidden_s: float


def pipeline_time_s(config: ParallelConfig, stages: list[StageEstimate], slowest: StageEstimate) -> float:
    """The pipeline part T of the step (see the module docstring)."""
    m, p, v = config.num_microbatches, config.pp, config.chunks_per_device
    t_max = slowest.time_per_microbatch_s
    if p == 1:
        return m * t_max
    if config.schedule == "interleaved":  # the fill and flush wait for the sends the steady state hides
        return m * t_max + (p - 1) / v * (t_max + slowest.p2p_hidden_s)
    if config.schedule == "zb1p":
        hops = sum(_zero_bubble_hop_s(stage) for stage in stages if stage is not slowest)
        return m * t_max + hops / v
    if config.schedule == "zbv":
        forward, weight = slowest.forward_pass_s, slowest.weight_grad_s
        backward = t_max - forward - weight
        return m * t_max + uniform_bubble_s("zbv", num_ranks=p, num_microbatches=m, num_chunks=2,
                                            forward_s=forward / 2, backward_s=backward / 2, weight_s=weight / 2)
    return (m - 1) * t_max + sum(s.time_per_microbatch_s for s in stages)


def pipeline_bound_s(config: ParallelConfig, stages: list[StageEstimate]) -> float:
    """A lower bound on pipeline_time_s, without laying out ZB-V: its pipeline rank p - 1 (the
    turn of the V) waits for the first microbatch's forward through the p - 1 chunks before it."""
    slowest = max(stages, key=lambda s: s.time_per_microbatch_s)
    if config.schedule != "zbv" or config.pp == 1:
        return pipeline_time_s(config, stages, slowest)
    return (config.num_microbatches * slowest.time_per_microbatch_s
            + (config.pp - 1) * slowest.forward_pass_s / config.chunks_per_device)


def _zero_bubble_hop_s(stage: StageEstimate) -> float:
    """What one stage adds to the fill and drain of ZB-H1: F + max(B - W, 0)."""
    backward = stage.time_per_microbatch_s - stage.forward_pass_s - stage.weight_grad_s
    return stage.forward_pass_s + max(backward - stage.weight_grad_s, 0.0)


def own_stages(config: ParallelConfig, rank: int) -> tuple[int, ...]:
    """Global pipeline stages (model chunks) of pipeline rank `rank`, in local chunk order."""
    return _stages_of_rank(config.schedule, rank, config.pp, config.chunks_per_device)


@lru_cache(maxsize=65536)
def _stages_of_rank(schedule: str, rank: int, num_ranks: int, num_chunks: int) -> tuple[int, ...]:
    return tuple(stages_of_rank(schedule, rank=rank, num_ranks=num_ranks, num_chunks=num_chunks))


def chunks_in_flight(config: ParallelConfig) -> tuple[float, ...]:
    """Per global pipeline stage (model chunk), the microbatches whose activations its rank
    holds at its peak."""
    return _in_flight_of_chunks(config.schedule, config.pp, config.num_microbatches, config.virtual_stages,
                                config.chunks_per_device)


@lru_cache(maxsize=65536)
def _in_flight_of_chunks(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
                         chunks_per_device: int) -> tuple[float, ...]:
    return tuple(_in_flight_of(schedule, stage, num_stages, num_microbatches, virtual_stages)
                 for stage in range(num_stages * chunks_per_device))


@lru_cache(maxsize=65536)
def _in_flight_of(schedule: str, stage: int, num_stages: int, num_microbatches: int, virtual_stages: int) -> float:
    rank = rank_of(schedule, stage=stage, num_ranks=num_stages)
    return chunk_microbatches_in_flight(schedule, rank=rank, chunk=stage // num_stages,
                                        num_stages=num_stages, num_microbatches=num_microbatches,
                                        virtual_stages=virtual_stages)

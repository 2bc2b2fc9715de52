"""Zero-bubble pipeline schedules (zb1p = torch's ScheduleInterleavedZeroBubble, zbv =
ScheduleZBVZeroBubble): their pass order against torch's own, their bubble and memory in the
step model against the closed forms of Qi et al. (2023), and their place in the search."""

import pytest

from autopar.plans.plan import Plan
from autopar.report.timeline import layout
from autopar.solver.pipeline import rank_of, stage_of, stages_of_rank
from autopar.solver.schedule_sim import uniform_bubble_s
from autopar.solver.schedules import rank_order
from autopar.solver.constraints import Constraints, schedule_accepts
from autopar.solver.step_model import ParallelConfig, PreparedSegments
from report_plans import evaluated, planner
from test_step_model import BACKWARD_S, FORWARD_S, model, segments

# The synthetic segments: forward 10 ms, of which 1 ms parameter-free (selective recompute);
# backward 20 ms. W = the weight-bearing forward = 9 ms, B = 20 - 9 = 11 ms per segment.
WEIGHT_S = FORWARD_S - 0.001
INPUT_S = BACKWARD_S - WEIGHT_S


# --- pass order: the same as torch's schedules ------------------------------------------------


def _torch_order(schedule: str, rank: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """torch's compute actions for `rank`, as (pass, local chunk, microbatch)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    kind = {"zb1p": torch_schedules.ScheduleInterleavedZeroBubble, "zbv": torch_schedules.ScheduleZBVZeroBubble}[schedule]
    schedule_object = kind.__new__(kind)
    schedule_object.pp_group_size, schedule_object.n_local_stages = p, v
    schedule_object._n_microbatches, schedule_object.num_stages = m, p * v
    schedule_object.number_of_rounds = max(1, m // p)
    schedule_object.microbatches_per_round = m // schedule_object.number_of_rounds
    actions = schedule_object._calculate_single_rank_operations(rank)
    local = {stage_of(schedule, rank=rank, chunk=chunk, num_ranks=p): chunk for chunk in range(v)}
    names = {"F": "F", "I": "B", "W": "W"}
    return [(names[action.computation_type.value], local[action.stage_index], action.microbatch_index)
            for action in actions if action is not None]


@pytest.mark.parametrize("schedule, p, m, v", [("zb1p", 4, 8, 1), ("zb1p", 2, 6, 1), ("zb1p", 4, 8, 2),
                                               ("zb1p", 2, 4, 3), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2),
                                               ("zbv", 4, 5, 2), ("zbv", 3, 12, 2)])
def test_pass_order_is_torchs(schedule, p, m, v):
    for rank in range(p):
        ours = rank_order(schedule, rank=rank, num_ranks=p, num_microbatches=m, num_chunks=v)
        assert ours == _torch_order(schedule, rank, p, m, v), f"rank {rank}"
        assert sorted(ours) == sorted((kind, chunk, j) for kind in "FBW" for chunk in range(v) for j in range(m))


def test_zbv_places_stages_in_a_v():
    p = 4
    assert [stages_of_rank("zbv", rank=k, num_ranks=p, num_chunks=2) for k in range(p)] == [[0, 7], [1, 6], [2, 5],
                                                                                           [3, 4]]
    assert [rank_of("zbv", stage=s, num_ranks=p) for s in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank_of("zb1p", stage=s, num_ranks=p) for s in range(2 * p)] == [0, 1, 2, 3, 0, 1, 2, 3]


# --- bubble: closed forms ---------------------------------------------------------------------


def _estimate(**config):
    config = ParallelConfig(dp=1, tp=1, microbatch_size=1, **config)
    return model().estimate(PreparedSegments.build(segments(), config.recompute), config)


@pytest.mark.parametrize("v", [1, 2])
def test_zb1p_bubble_is_p_minus_1_hops_of_f_plus_b_minus_w(v):
    p, m = 4, 8
    result = _estimate(pp=p, num_microbatches=m, schedule="zb1p", virtual_stages=v)
    per_stage = 8 // p  # segments per stage
    hop = per_stage * (FORWARD_S + INPUT_S - WEIGHT_S)  # ZB-H1: (p - 1)(T_F + T_B - T_W)
    assert result.breakdown_s["bubble"] == pytest.approx((p - 1) * hop / v, rel=1e-9)
    one_f_one_b = _estimate(pp=p, num_microbatches=m)
    assert one_f_one_b.breakdown_s["bubble"] == pytest.approx((p - 1) * per_stage * (FORWARD_S + BACKWARD_S))


def test_zero_bubble_when_weight_gradients_fill_the_drain():
    """ZB-H1 with W >= B: the bubble is (p - 1) forwards (T_F + max(T_B - T_W, 0))."""
    from dataclasses import replace

    items = [replace(segment, selective_recompute=type(segment.selective_recompute)()) for segment in segments()]
    for segment in items:
        segment.backward = type(segment.backward)(matmul_s=1.5 * FORWARD_S)  # W = 10 ms > B = 5 ms
    config = ParallelConfig(dp=1, tp=1, pp=4, microbatch_size=1, num_microbatches=8, schedule="zb1p")
    result = model().estimate(PreparedSegments.build(items, "none"), config)
    assert result.breakdown_s["bubble"] == pytest.approx(3 * 2 * FORWARD_S, rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_bubble_with_equal_passes_is_p_minus_1_passes(p):
    """ZB-V with F = B = W per chunk: only the fill of the last rank's first forward is idle,
    (p - 1) passes, and it does not grow with m."""
    tau = 0.25
    for m in (2 * p - 1, 2 * p, 5 * p):
        bubble = uniform_bubble_s("zbv", num_ranks=p, num_microbatches=m, num_chunks=2, forward_s=tau,
                                  backward_s=tau, weight_s=tau)
        assert bubble == pytest.approx((p - 1) * tau, rel=1e-5)


def test_zbv_in_the_step_model_is_its_uniform_layout():
    p, m = 2, 8
    result = _estimate(pp=p, num_microbatches=m, schedule="zbv", virtual_stages=2)
    chunk = 8 // (2 * p)  # segments per chunk
    expected = uniform_bubble_s("zbv", num_ranks=p, num_microbatches=m, num_chunks=2,
                                forward_s=chunk * FORWARD_S, backward_s=chunk * INPUT_S, weight_s=chunk * WEIGHT_S)
    assert result.breakdown_s["bubble"] == pytest.approx(expected, rel=1e-6)
    assert result.breakdown_s["bubble"] < _estimate(pp=p, num_microbatches=m).breakdown_s["bubble"] / 2
    assert [stage.chunks for stage in result.stages] == [(("layers.0", "layers.1"), ("layers.6", "layers.7")),
                                                         (("layers.2", "layers.3"), ("layers.4", "layers.5"))]


# --- memory: deferred weight gradients hold activations --------------------------------------


def test_deferred_weight_gradients_hold_more_activations():
    p, m = 4, 8
    activations = lambda result: [stage.memory_bytes["activations"] for stage in result.stages]  # noqa: E731
    per_stage = (8 // p) * 1e8  # saved bytes of one microbatch on one stage
    assert activations(_estimate(pp=p, num_microbatches=m)) == pytest.approx([per_stage * (p - k) for k in range(p)])
    # zb1p: rank k defers k weight gradients: p microbatches on every rank
    assert activations(_estimate(pp=p, num_microbatches=m, schedule="zb1p")) == pytest.approx([per_stage * p] * p)
    # zbv: rank k holds chunk 0 for 2p - 1 - k microbatches and chunk 1 for k + 1, each half a stage
    zbv = activations(_estimate(pp=p, num_microbatches=m, schedule="zbv", virtual_stages=2))
    assert zbv == pytest.approx([per_stage / 2 * (2 * p - 1 - k + k + 1) for k in range(p)])


# --- the search and the plan ------------------------------------------------------------------


def test_schedules_accept_what_torch_runs():
    assert schedule_accepts("zb1p", 4, 4) and not schedule_accepts("zb1p", 4, 3)
    assert not schedule_accepts("zb1p", 4, 9)  # torch: 9 is not a multiple of its 2 rounds
    assert schedule_accepts("zb1p", 4, 8, 2) and not schedule_accepts("zb1p", 4, 6, 2)
    assert schedule_accepts("zbv", 2, 3) and not schedule_accepts("zbv", 4, 3)


def test_search_prices_zero_bubble_schedules_beside_1f1b_and_interleaved():
    schedules = planner().candidates.schedules(2, Constraints())
    assert ("1f1b", 1) in schedules and ("interleaved", 2) in schedules
    assert ("zb1p", 1) in schedules and ("zbv", 2) in schedules
    assert ("zb1p", 2) in planner().candidates.schedules(2, Constraints(schedule="zb1p"))
    result = planner().search(Constraints(pp=2, tp=2, microbatch_size=1, recompute="none", zero_stage=0), keep=40)
    by_schedule = {estimate.config.schedule: estimate for estimate in result.ranked}
    assert {"1f1b", "interleaved", "zb1p", "zbv"} <= set(by_schedule)
    # with memory to spare, a zero-bubble schedule's smaller bubble beats 1F1B, though only 1F1B and
    # interleaved accumulate weight gradients inside their GEMMs (codegen/fused_wgrad.py), which
    # here lets interleaved win
    assert min(by_schedule[name].step_time_s for name in ("zb1p", "zbv")) < by_schedule["1f1b"].step_time_s
    assert result.best.config.schedule in ("zb1p", "zbv", "interleaved")
    assert by_schedule["1f1b"].stages[0].fused_wgrad_numel > 0 == by_schedule["zbv"].stages[0].fused_wgrad_numel
    assert by_schedule["zb1p"].breakdown_s["bubble"] < by_schedule["1f1b"].breakdown_s["bubble"]


@pytest.mark.parametrize("schedule, virtual", [("zb1p", 1), ("zbv", 2)])
def test_zero_bubble_plan_round_trips_and_draws_weight_passes(schedule, virtual):
    plan = evaluated(schedule=schedule, virtual_stages=virtual if schedule == "zb1p" else None)
    assert plan.schedule == schedule and plan.virtual_stages == virtual
    assert Plan.from_dict(plan.to_dict()) == plan
    for stage in plan.stages:
        assert len(stage.chunk_times_s) == virtual
        assert all(parts["weight"] > 0 for parts in stage.chunk_times_s)
        assert sum(sum(parts.values()) for parts in stage.chunk_times_s) == pytest.approx(stage.time_per_microbatch_s)
    timeline = layout(plan)
    assert timeline.num_chunks == virtual
    weights = [block for block in timeline.blocks if block.kind == "weight"]
    assert len(weights) == plan.mesh["pp"] * virtual * plan.num_microbatches
    assert abs(timeline.mismatch) < 0.03, timeline.mismatch
    assert "zero-bubble" in plan.summary()


def test_zbv_needs_two_chunks_and_a_pipeline():
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="zbv.*2 model chunks"):
        planner().check(ParallelConfig(dp=2, tp=2, pp=2, microbatch_size=1, num_microbatches=8, schedule="zbv",
                                       virtual_stages=3))
    with pytest.raises(ConfigError, match="pp >= 2"):
        planner().check(ParallelConfig(dp=4, tp=2, pp=1, microbatch_size=1, num_microbatches=4, schedule="zb1p"))


def test_zero3_is_never_paired_with_a_zero_bubble_schedule():
    """FSDP's reshard after forward does not survive torch's split backward (measured: gradients
    wrong on gloo, tests/dist/test_numerics.py runs zbv with ZeRO-1): the search does not offer it,
    and a configuration, constraints or a plan file that asks for it is refused with the reason."""
    from autopar.errors import ConfigError, PlanMismatchError
    from autopar.solver.constraints import check_constraint_values

    result = planner().search(Constraints(pp=2, tp=1, microbatch_size=1, recompute="none"), keep=200)
    pairs = {(estimate.config.schedule, estimate.config.zero_stage) for estimate in result.ranked}
    assert ("zbv", 1) in pairs and ("1f1b", 3) in pairs  # both kinds were priced...
    assert not any(schedule in ("zb1p", "zbv") and zero == 3 for schedule, zero in pairs)  # ...never together
    with pytest.raises(ConfigError, match="zero_stage 3.*weight-gradient pass"):
        planner().check(ParallelConfig(dp=4, tp=1, pp=2, microbatch_size=1, num_microbatches=4, schedule="zbv",
                                       virtual_stages=2, zero_stage=3))
    with pytest.raises(ConfigError, match="zb1p.*zero_stage 3"):
        check_constraint_values({"schedule": "zb1p", "zero_stage": 3})
    data = evaluated(schedule="zbv", zero_stage=1).to_dict()
    with pytest.raises(PlanMismatchError, match="zbv.*zero_stage 3"):
        Plan.from_dict({**data, "zero_stage": 3})


def test_a_tied_weight_is_priced_as_each_rank_holds_it():
    """The tied embedding (read by the first and the last segment) is one copy per pipeline rank
    that reads it: under 1F1B the last rank holds a copy more than its segments; under ZB-V rank 0
    reads it in both its chunks and FSDP (ZeRO >= 1) leaves it whole there, as ZeRO-0."""
    from autopar import api

    model = planner()
    ((tied, _),) = model.step_model.shared_params  # the embedding and head
    assert tied > 0

    def stages(schedule, zero):
        config = api.fixed_config(model, tp=1, pp=2, dp=None, microbatch_size=1, schedule=schedule, virtual_stages=None,
                                  layers_per_virtual_stage=None, recompute="none", zero_stage=zero)
        estimate, _ = model.evaluate(config)
        return estimate.config, estimate.stages

    config, (first, last) = stages("1f1b", 0)
    segments = model.prepared_for(config).param_numel
    assert last.param_numel == pytest.approx(segments[len(segments) // 2:].sum() + tied, rel=1e-9)  # the copy
    dp, adam_bytes = config.dp, 12  # fp32 master + two moments: what ZeRO-1 shards
    _, (first_sharded, _) = stages("1f1b", 1)
    assert first_sharded.memory_bytes["optimizer"] == pytest.approx(adam_bytes * first_sharded.param_numel / dp)
    _, (zbv_rank0, _) = stages("zbv", 1)
    rest = zbv_rank0.param_numel - tied
    assert zbv_rank0.memory_bytes["optimizer"] == pytest.approx(adam_bytes * (rest / dp + tied), rel=1e-9)

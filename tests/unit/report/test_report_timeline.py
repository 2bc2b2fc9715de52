"""The timeline picture: the schedules' pass order, the layout from the step model, and what the
drawn figure shows (blocks per rank, drawn length against the predicted step time)."""

from dataclasses import replace

import pytest

from autopar.errors import PlanMismatchError
from autopar.plans.plan import Plan
from autopar.report.draw import timeline_figure
from autopar.report.schedules import rank_order
from autopar.report.timeline import layout
from report_plans import evaluated

# --- pass order ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, num_chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_every_pass_runs_once_per_microbatch_and_chunk(schedule, num_chunks):
    p, m = 4, 8
    for rank in range(p):
        order = rank_order(schedule, rank=rank, num_ranks=p, num_microbatches=m, num_chunks=num_chunks)
        expected = {(kind, chunk, j) for kind in "FB" for chunk in range(num_chunks) for j in range(m)}
        assert sorted(order) == sorted(expected)
        # a backward never comes before its own forward
        for index, (kind, chunk, j) in enumerate(order):
            if kind == "B":
                assert ("F", chunk, j) in order[:index]


def _max_in_flight(order):
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def test_in_flight_microbatches_follow_the_schedule():
    p, m = 4, 8
    assert [_max_in_flight(rank_order("1f1b", rank=k, num_ranks=p, num_microbatches=m)) for k in range(p)] == [4, 3, 2, 1]
    assert all(_max_in_flight(rank_order("gpipe", rank=k, num_ranks=p, num_microbatches=m)) == m for k in range(p))
    # interleaved warmup: (v - 1) p + 2 (p - 1 - rank) forwards, then one more before the first backward
    order = rank_order("interleaved", rank=0, num_ranks=p, num_microbatches=m, num_chunks=2)
    first_backward = next(i for i, step in enumerate(order) if step[0] == "B")
    assert first_backward == (2 - 1) * p + 2 * (p - 1) + 1


# --- layout from the plan's step model -------------------------------------------------------


def test_chunk_parts_add_up_to_the_stage_time_and_survive_json():
    plan = evaluated(schedule="interleaved", virtual_stages=2, recompute="full")
    for stage in plan.stages:
        assert len(stage.chunk_times_s) == 2
        assert sum(sum(parts.values()) for parts in stage.chunk_times_s) == pytest.approx(stage.time_per_microbatch_s)
        assert all(parts["recompute"] > 0 for parts in stage.chunk_times_s)
    assert Plan.from_dict(plan.to_dict()).stages == plan.stages


def _synthetic(plan: Plan, *, forward_s: float, backward_s: float, tp_s: float) -> Plan:
    """Every stage and chunk costs the same: the step model's closed form is then exact."""
    num_chunks = len(plan.stages[0].chunk_times_s)
    parts = {"forward": forward_s, "backward": backward_s, "recompute": 0.0, "tp.all_reduce.forward": tp_s,
             "tp.all_reduce.backward": tp_s}
    per_microbatch = num_chunks * sum(parts.values())
    stages = tuple(replace(stage, chunk_times_s=(dict(parts),) * num_chunks, time_per_microbatch_s=per_microbatch)
                   for stage in plan.stages)
    m, p, v = plan.num_microbatches, plan.mesh["pp"], num_chunks
    pipeline = (m + (p - 1) / v) * per_microbatch if plan.schedule == "interleaved" else (m - 1 + p) * per_microbatch
    tail = 0.25 * per_microbatch
    predicted = replace(plan.predicted, step_time_s=pipeline + tail,
                        breakdown_s={"compute": m * per_microbatch, "bubble": pipeline - m * per_microbatch,
                                     "optimizer": tail})
    return replace(plan, stages=stages, predicted=predicted)


@pytest.mark.parametrize("kwargs", [dict(pp=4, tp=1), dict(pp=4, tp=1, schedule="gpipe"),
                                    dict(pp=4, tp=1, schedule="interleaved", virtual_stages=2)])
def test_identical_stages_lay_out_to_the_closed_form_exactly(kwargs):
    plan = _synthetic(evaluated(**kwargs), forward_s=1.0, backward_s=2.0, tp_s=0.5)
    timeline = layout(plan)
    assert timeline.end_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    # the slowest rank idles exactly the step model's bubble
    assert min(timeline.bubble_s(rank) for rank in range(timeline.num_ranks)) == pytest.approx(
        plan.predicted.breakdown_s["bubble"], rel=1e-9)


def test_a_plan_without_chunk_times_asks_to_replan():
    plan = evaluated()
    old = replace(plan, stages=tuple(replace(stage, chunk_times_s=()) for stage in plan.stages))
    with pytest.raises(PlanMismatchError, match="re-run `autopar plan`"):
        layout(old)


# --- the drawn picture -----------------------------------------------------------------------


def _drawn(figure):
    """Rectangles of the main axes by gid: {"forward:0": [(x, width), ...]}."""
    axes = figure.axes[0]
    found = {}
    for collection in axes.collections:
        gid = collection.get_gid()
        if gid:
            found[gid] = [(path.vertices[:, 0].min(), path.vertices[:, 0].max()) for path in collection.get_paths()]
    return axes, found


@pytest.mark.parametrize("kwargs, passes", [
    (dict(pp=2), 2),
    (dict(pp=4, tp=1, schedule="gpipe"), 2),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, recompute="full"), 3),
    (dict(pp=2, schedule="interleaved", virtual_stages=4, recompute="selective"), 3),
    (dict(pp=1, recompute="selective", zero_stage=3), 3),
])
def test_picture_shows_every_pass_and_lasts_the_predicted_step(kwargs, passes):
    plan = evaluated(**kwargs)
    chunks = plan.virtual_stages if plan.schedule == "interleaved" else 1
    axes, drawn = _drawn(timeline_figure(plan, zoom=False))
    kinds = ("forward", "backward", "recompute")
    for rank in range(plan.mesh["pp"]):
        blocks = sum(len(drawn.get(f"{kind}:{rank}", ())) for kind in kinds)
        assert blocks == plan.num_microbatches * chunks * passes
    right_edge = max(end for spans in drawn.values() for _, end in spans)
    assert right_edge == pytest.approx(plan.predicted.step_time_s, rel=0.01)
    assert axes.get_xlim()[1] == pytest.approx(right_edge)
    # the step tail (optimizer) is drawn once per rank, after every pass
    last_pass = max(end for gid, spans in drawn.items() if gid.split(":")[0] in kinds for _, end in spans)
    assert all(start >= last_pass * (1 - 1e-9) for start, _ in drawn["optimizer:0"])


def test_collectives_are_drawn_inside_their_passes():
    plan = _synthetic(evaluated(pp=2), forward_s=1.0, backward_s=2.0, tp_s=0.5)
    _, drawn = _drawn(timeline_figure(plan, zoom=False))
    for rank in range(2):
        strips = drawn[f"comm.tp:{rank}"]
        assert len(strips) == 2 * plan.num_microbatches
        assert sum(end - start for start, end in strips) == pytest.approx(2 * 0.5 * plan.num_microbatches)


def test_long_pipelines_get_an_enlarged_start():
    plan = evaluated(pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=4)
    figure = timeline_figure(plan)
    assert len(figure.axes) >= 2
    zoom_gids = {c.get_gid() for c in figure.axes[1].collections}
    assert "zoom.forward:0" in zoom_gids


def test_interleaving_unequal_chunks_runs_longer_than_the_closed_form():
    """(m + (p - 1) / v) t_max assumes equal chunks; here the first and last of eight one-layer
    chunks also hold the embedding and the head, and the schedule as it runs takes a little
    longer. The picture shows what runs and says by how much it differs."""
    plan = evaluated(pp=4, tp=1, schedule="interleaved", virtual_stages=2, recompute="selective")
    timeline = layout(plan)
    assert 0 < timeline.mismatch < 0.02
    figure = timeline_figure(plan, timeline, zoom=False)
    assert f"{100 * timeline.mismatch:+.2f}%" in figure.axes[0].get_title(loc="left")

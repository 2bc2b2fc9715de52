"""The memory picture: one stacked bar per pipeline stage, the plan's numbers, the usable line."""

import pytest

from autopar.report.draw import memory_figure
from autopar.report.memory import MEMORY_PARTS, memory_layout
from report_plans import evaluated

GIB = 2.0**30


@pytest.mark.parametrize("kwargs", [dict(pp=4, tp=1), dict(pp=2, schedule="interleaved", virtual_stages=2,
                                                          recompute="full", zero_stage=1)])
def test_bars_are_the_plans_memory_per_stage(kwargs):
    plan = evaluated(**kwargs)
    chart = memory_layout(plan)
    assert [bar.stage for bar in chart.bars] == [stage.index for stage in plan.stages]
    figure = memory_figure(plan, chart)
    axes = figure.axes[0]
    drawn: dict[str, list] = {}
    for patch in axes.patches:
        drawn.setdefault(patch.get_gid(), []).append(patch)
    for part in MEMORY_PARTS:
        expected = [stage.memory_bytes.get(part, 0.0) / GIB for stage in plan.stages]
        if not any(expected):
            assert f"memory:{part}" not in drawn
            continue
        heights = [patch.get_height() for patch in sorted(drawn[f"memory:{part}"], key=lambda p: p.get_x())]
        assert heights == pytest.approx(expected)
    # the stack tops are the stage totals, the margin fills up to the usable line
    budget = plan.predicted.memory_budget_bytes / GIB
    for index, stage in enumerate(plan.stages):
        margin = sorted(drawn["memory:margin"], key=lambda p: p.get_x())[index]
        assert margin.get_y() == pytest.approx(sum(stage.memory_bytes.values()) / GIB)
        assert margin.get_y() + margin.get_height() == pytest.approx(budget)
        assert chart.margin_bytes(index) == pytest.approx(plan.predicted.memory_budget_bytes
                                                          - sum(stage.memory_bytes.values()))
    usable = [line for line in axes.lines if line.get_gid() == "memory:usable"]
    assert usable and usable[0].get_ydata()[0] == pytest.approx(budget)
    peak = chart.bars[chart.peak_stage]
    assert peak.total_bytes == pytest.approx(plan.predicted.peak_memory_bytes)

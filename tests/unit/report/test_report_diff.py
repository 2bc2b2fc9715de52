"""`autopar diff`: settings, stages, placements and predictions that differ between two plans."""

import json
from dataclasses import replace

from autopar.cli import main
from autopar.report.diff import diff_plans, diff_text
from report_plans import evaluated


def test_a_plan_does_not_differ_from_itself():
    plan = evaluated()
    found = diff_plans(plan, plan)
    assert found.same_choices and "same choices" in diff_text(plan, plan)


def test_schedule_recompute_stages_and_placements_that_differ():
    a = evaluated(pp=2, tp=2)
    b = evaluated(pp=2, tp=2, schedule="interleaved", virtual_stages=2, recompute="full")
    found = diff_plans(a, b)
    names = {name for name, _, _ in found.settings}
    assert {"schedule", "recompute"} <= names and "mesh" not in names
    assert found.stages  # chunks and recomputation per stage changed
    terms = {term.strip(): (left, right) for term, _, left, right in found.predicted}
    assert terms["step time"] == (a.predicted.step_time_s, b.predicted.step_time_s)
    assert terms["peak memory"] == (a.predicted.peak_memory_bytes, b.predicted.peak_memory_bytes)


def test_placements_of_identical_blocks_fold_into_one_line(capsys, tmp_path):
    a = evaluated(pp=1, tp=1)
    # the tiny model stays replicated at any tp: give B column-parallel MLP inputs by hand
    b = replace(evaluated(pp=1, tp=8), param_placements={
        name: "S0" if ".mlp.fc_in." in name else placement for name, placement in a.param_placements.items()})
    found = diff_plans(a, b)
    assert ("layers.*.mlp.fc_in.weight", "R", "S0", 8) in found.placements
    changed = {name for name in a.param_placements if a.param_placements[name] != b.param_placements.get(name)}
    assert changed and sum(count for *_, count in found.placements) == len(changed)
    assert all("layers.*" in pattern or not pattern.startswith("layers.") for pattern, *_ in found.placements)
    a_path, b_path = tmp_path / "a.json", tmp_path / "b.json"
    a.save(a_path)
    b.save(b_path)
    assert main(["diff", str(a_path), str(b_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"name": "mesh", "a": "pp=1 dp=8 tp=1", "b": "pp=1 dp=1 tp=8"} in data["settings"]

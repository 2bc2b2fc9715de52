"""`autopar explain`: the runners-up's terms against the chosen plan's, in one table."""

import json

import pytest

from autopar import evaluate
from autopar.cli import main
from autopar.report.explain import explain, explain_text
from report_plans import evaluated, searched


def test_rows_are_the_differences_of_each_term():
    plan = searched()
    others = plan.search["runners_up"]
    assert others, "the search keeps runners-up"
    explanation = explain(plan, max_alternatives=2)
    assert len(explanation.alternatives) == min(2, len(others))
    rows = {(row.term, row.unit): row for row in explanation.rows}
    for index, other in enumerate(others[:2]):
        assert rows[("step time", "s")].deltas[index] == pytest.approx(other["step_time_s"] - plan.predicted.step_time_s)
        for term, seconds in other["breakdown_s"].items():
            if (term, "s") in rows:
                assert rows[(term, "s")].deltas[index] == pytest.approx(seconds - plan.predicted.breakdown_s.get(term, 0))
        for part, size in other["memory_bytes"].items():
            if (part, "bytes") in rows:
                assert rows[(part, "bytes")].deltas[index] == pytest.approx(size - plan.predicted.memory_bytes.get(part, 0))
        # what differs is named from the settings of both
        for change in explanation.alternatives[index].changes:
            name, before, _, after = change.split(" ")
            assert str(other["settings"][name]) == after and before != after


def test_text_names_each_alternative_and_why_it_lost(capsys, tmp_path):
    plan = searched()
    text = explain_text(plan)
    assert "#1" in text and "chosen" in text and "step time" in text and "peak memory" in text
    assert "slower" in text or "faster" in text
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["explain", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["alternatives"][0]["config"] == plan.search["runners_up"][0]["config"]


def test_an_evaluated_plan_has_no_runners_up():
    assert "no runners-up" in explain_text(evaluated())


def test_expert_parallel_terms_and_the_load_imbalance_are_shown():
    """An MoE plan's all-to-alls (ep.dispatch, ep.combine) are rows of the table, and the load
    imbalance its expert ops were priced with is stated."""
    plan = evaluate("moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4", cluster="dgx-h100:nodes=1",
                    global_batch=16, tp=1, pp=1, dp=8, microbatch_size=2, ep=4, moe_load_imbalance=1.5)
    text = explain_text(plan)
    assert "ep.dispatch" in text and "ep.combine" in text
    assert "load imbalance 1.5" in text


def test_an_fp8_plan_says_what_float8_buys():
    """The fp8 pricing's note: the bf16 matmul time replaced, each added term, the net change."""
    from autopar.report.explain import explain_dict

    big = "gpt:layers=1,hidden=16384,heads=128,seq=4096,vocab=1024"
    plan = evaluate(big, cluster="dgx-h100:gpus_per_node=1", global_batch=4, microbatch_size=4, precision="fp8")
    text = explain_text(plan)
    assert "fp8 buys: 6 of 6 eligible linears in float8 (tensorwise scaling, compiled casts): matmuls " in text
    assert "in bf16, fp8.cast +" in text and "; saves " in text
    assert explain_dict(plan)["fp8"] == [line.strip() for line in text.splitlines() if "fp8 buys" in line]
    assert "fp8" not in explain_dict(evaluate(big, cluster="dgx-h100:gpus_per_node=1", global_batch=4,
                                              microbatch_size=4))

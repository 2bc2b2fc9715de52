"""`autopar verify` end to end: a tiny built-in model's kinds on 2 spawned gloo processes match one
process, and a wrong reference shows as MISMATCH with exit status 1."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main

pytestmark = pytest.mark.dist

MODEL = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"


def test_every_kind_of_a_tiny_gpt_matches_one_process(capsys):
    code = main(["verify", MODEL, "--nproc", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    cells = {cell["kind"]: cell for cell in report["cells"]}
    assert code == 0 and report["ok"], report
    for kind in ("dp", "tp", "pp"):
        assert cells[kind]["result"] == "match", cells[kind]
        assert cells[kind]["max_deviation"] <= report["tolerance"]
        assert len(cells[kind]["losses"]) == 3
    assert cells["tp"]["sharded_params"] > 0  # the planner really split the matmuls
    assert cells["cp"]["result"] == "n/a" and "scaled_dot_product_attention" in cells["cp"]["reason"]
    assert cells["ep"]["result"] == "n/a" and "expert" in cells["ep"]["reason"]


def test_a_wrong_reference_is_a_mismatch_and_exit_status_1(capsys, monkeypatch):
    from autopar.tune import verify

    exact = verify.reference_losses
    monkeypatch.setattr(verify, "reference_losses", lambda setup: [loss + 1e-3 for loss in exact(setup)])
    code = main(["verify", MODEL, "--nproc", "2", "--kinds", "tp", "--steps", "1"])
    table = capsys.readouterr().out.splitlines()
    assert code == 1
    assert table[2].startswith("tp ") and table[2].endswith("MISMATCH")
    assert table[-1].endswith("1 MISMATCH; NOT exact")

"""`autopar verify`: which kinds run, the tiny copy of a spec, and the table (no processes)."""

import pytest

from autopar.errors import ConfigError, ModelSpecError
from autopar.tune.verify import TOLERANCE, Cell, VerifyReport, compare, format_table, select_kinds, tiny_spec


def test_two_processes_run_the_single_axes_and_four_add_the_mixes():
    two = ["dp", "tp", "pp", "cp", "ep", "zero3", "recompute", "interleaved", "ep x zero3"]
    assert [kind.name for kind in select_kinds(2)] == two
    assert [kind.name for kind in select_kinds(4)] == two + ["dp x tp", "pp x tp", "pp x dp", "dp x cp", "ep x tp",
                                                             "ep x pp", "ep x cp"]
    assert all(kind.world_size == 2 for kind in select_kinds(4)[:len(two)])


def test_named_kinds_keep_their_order_and_refuse_what_needs_more_processes():
    assert [kind.name for kind in select_kinds(4, ["ppxtp", "DP", "pp x tp"])] == ["pp x tp", "dp"]
    with pytest.raises(ConfigError, match="--nproc 4"):
        select_kinds(2, ["dpxtp"])
    with pytest.raises(ConfigError, match="unknown plan kind 'zz'"):
        select_kinds(2, ["zz"])
    with pytest.raises(ConfigError, match="2 or 4 processes"):
        select_kinds(3)


def test_a_spec_is_shrunk_to_the_tiny_sizes_keeping_other_keys():
    assert tiny_spec("llama3-8b") == ("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=176,seq=32,vocab=128,"
                                      "rope_theta=500000.0,norm_eps=1e-05,norm=fused")
    shrunk = tiny_spec("gpt:layers=1,hidden=32,heads=2,attention=sdpa,dropout=0.2")
    assert "layers=1,hidden=32,heads=2" in shrunk and "attention=sdpa" in shrunk and "dropout=0.0" in shrunk
    assert tiny_spec("gpt:hidden=96,heads=12").startswith("gpt:layers=2,hidden=64,heads=4")  # 64 % 12: the defaults
    assert tiny_spec("examples/x.py:make") == "examples/x.py:make"
    with pytest.raises(ModelSpecError):
        tiny_spec("no-such-model")


def test_losses_within_the_tolerance_match_and_others_do_not():
    reference = [2.0, 1.5, 1.0]
    close = compare("tp", dict(mesh="tp=2", sharded_params=4, losses=[2.0, 1.5 + TOLERANCE / 2, 1.0]), reference)
    far = compare("tp", dict(mesh="tp=2", sharded_params=4, losses=[2.0, 1.5, 1.0 + 3 * TOLERANCE]), reference)
    refused = compare("cp", dict(result="n/a", reason="no attention"), reference)
    assert (close.result, far.result, refused.result) == ("match", "MISMATCH", "n/a")
    assert far.max_deviation == pytest.approx(3 * TOLERANCE)


def test_the_table_shows_each_cell_and_the_verdict():
    cells = [Cell(kind="dp", result="match", mesh="dp=2", max_deviation=4.8e-7, sharded_params=0),
             Cell(kind="cp", result="n/a", reason="no attention"),
             Cell(kind="tp", result="error", mesh="tp=2", sharded_params=3, reason="RuntimeError: boom")]
    report = VerifyReport(model="gpt:layers=2", steps=3, reference_losses=[1.0, 1.0, 1.0], cells=cells)
    lines = format_table(report).splitlines()
    assert lines[0].split(" | ")[0].strip() == "kind" and len(lines) == 2 + 3 + 1
    assert "4.80e-07" in lines[2] and lines[2].endswith("match")
    assert lines[3].endswith("n/a: no attention") and lines[4].endswith("error: RuntimeError: boom")
    assert not report.ok and lines[-1].endswith("1 match, 1 error, 1 n/a; NOT exact")
    exact = VerifyReport(model="m", steps=3, reference_losses=[], cells=cells[:2])
    assert exact.ok and "exact" in format_table(exact).splitlines()[-1]
    assert exact.to_dict()["ok"] is True


FACTORY = '''
import torch
from torch import nn

def make():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    return model, (torch.randn(4, 8),), nn.functional.cross_entropy, torch.randint(0, 2, (4,))

def no_loss():
    return nn.Linear(8, 2), (torch.randn(4, 8),)
'''


def test_a_factory_runs_as_it_is_without_dropout_on_its_one_batch(tmp_path):
    import torch

    from autopar.tune.verify import _setup, reference_losses

    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    setup = _setup(f"{path}:make", steps=3, batch_size=4)
    assert [module.p for module in setup.model.modules() if isinstance(module, torch.nn.Dropout)] == [0.0]
    assert len(setup.batches) == 3 and setup.batches[0] is setup.batches[2]
    again = _setup(f"{path}:make", steps=3, batch_size=4)  # fixed seeds: every process builds the same
    assert torch.equal(setup.batches[0][0][0], again.batches[0][0][0])
    assert reference_losses(setup) == reference_losses(again)
    with pytest.raises(ConfigError, match="no loss_fn"):
        _setup(f"{path}:no_loss", steps=1, batch_size=4)


def test_a_built_in_spec_draws_a_new_batch_each_step():
    import torch

    from autopar.tune.verify import _setup

    setup = _setup(tiny_spec("tiny-gpt"), steps=2, batch_size=4)
    assert not torch.equal(setup.batches[0][0][0], setup.batches[1][0][0])
    assert setup.batches[0][0][0].shape == (4, 32)


def test_a_kind_whose_random_ops_are_drawn_per_replica_is_labelled_not_a_mismatch():
    reference = [2.0, 1.5, 1.0]
    drawn = dict(mesh="dp=2", sharded_params=0, losses=[2.0, 1.5, 1.01], random_ops=["aten.exponential_.default"],
                 draws="dp=2 replicas")
    cell = compare("dp", drawn, reference)
    assert cell.result == "random" and "dp=2 replicas" in cell.reason and "exponential_" in cell.reason
    tp_only = compare("tp", {**drawn, "mesh": "tp=2", "draws": ""}, reference)  # tp draws as one process: compared
    assert tp_only.result == "MISMATCH"
    close = compare("dp", {**drawn, "losses": reference}, reference)
    assert close.result == "match"
    report = VerifyReport(model="m", steps=3, reference_losses=reference, cells=[cell, close])
    lines = format_table(report).splitlines()
    assert report.ok and "random ops: drawn per replica (dp=2 replicas" in lines[2]
    assert lines[-1].endswith("1 match, 1 random; exact where comparable: the other kinds that run match one process")


def _plan(*, microbatches: int = 1, ep: int = 1, etp: int = 1, **mesh):
    from types import SimpleNamespace

    return SimpleNamespace(mesh={"dp": 1, "tp": 1, "pp": 1, **mesh}, num_microbatches=microbatches, ep=ep, etp=etp)


def test_only_tensor_parallelism_alone_draws_as_one_process():
    from autopar.tune.verify import per_replica_draws

    assert per_replica_draws(_plan(tp=4)) == ""
    assert per_replica_draws(_plan(dp=2, tp=2)) == "dp=2 replicas"
    assert per_replica_draws(_plan(pp=2, microbatches=4)) == "pp=2 stages, 4 microbatches"
    assert per_replica_draws(_plan(cp=2, tp=2)) == "cp=2 sequence shares"
    assert per_replica_draws(_plan(dp=2, tp=2, ep=2, etp=1)) == "dp=2 replicas, MoE layers folded on each tp rank's tokens"

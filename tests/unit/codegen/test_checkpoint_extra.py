"""A checkpoint's extra is data: values and tensors round-trip through DCP, what has no data form is
refused at save time naming it, and a planted pickle or a tampered extra runs nothing."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from autopar.codegen import checkpoint_extra


def test_values_and_tensors_round_trip():
    extra = {"step": 7, "loss": 2.5, "nan": float("nan"), "name": "run", "flags": [True, None],
             "shape": (2, 3), "nested": {"rng": torch.arange(6, dtype=torch.uint8), "epoch": 1}}
    text, tensors = checkpoint_extra.encode(extra)
    back = checkpoint_extra.decode(text, tensors)
    assert back["shape"] == (2, 3) and back["flags"] == [True, None] and back["nan"] != back["nan"]
    assert torch.equal(back["nested"]["rng"], extra["nested"]["rng"])
    assert {key: value for key, value in back.items() if key not in ("nan", "nested")} == \
        {key: value for key, value in extra.items() if key not in ("nan", "nested")}


@pytest.mark.parametrize("extra, fragment", [
    ({"model": nn.Linear(2, 2)}, "extra['model'] is a torch.nn.modules.linear.Linear"),
    ({"run": {"when": object()}}, "extra['run']['when'] is a builtins.object"),
    ({1: "one"}, "string keys"),
    ({"fn": print}, "extra['fn']"),
])
def test_what_is_not_data_is_refused_naming_it(extra, fragment):
    with pytest.raises(checkpoint_extra.ExtraError, match="data only|string keys") as error:
        checkpoint_extra.encode(extra)
    assert fragment in str(error.value)


class Exploit:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("text", ['{"dict": {"x": {"pickle": "gASV"}}}', '[1, 2]', "not json", '{"dict": NaN}',
                                  '{"dict": {"t": {"tensor": 3}}}'])
def test_a_tampered_extra_is_refused(text):
    with pytest.raises(checkpoint_extra.ExtraError, match="changed after the save"):
        checkpoint_extra.decode(text, {})


def test_a_pickled_extra_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    with pytest.raises(checkpoint_extra.ExtraError):
        checkpoint_extra.decode(pickle.dumps(Exploit(marker)), {})
    assert not marker.exists()


def test_save_and_load_through_dcp(one_process_group, tmp_path):
    import autopar
    from autopar.codegen.checkpoint import CheckpointError

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    inputs = torch.randn(4, 8)
    pm = autopar.parallelize(model, "cpu:procs=1", (inputs,), loss_fn=lambda out, target: out.pow(2).mean(),
                             example_targets=torch.zeros(4, 4))
    rng = torch.get_rng_state()
    pm.save(tmp_path / "ckpt", extra={"step": 3, "rng": rng, "sampler": {"seen": [0, 1, 2]}})
    back = pm.load(tmp_path / "ckpt")
    assert back["step"] == 3 and back["sampler"] == {"seen": [0, 1, 2]} and torch.equal(back["rng"], rng)
    with pytest.raises(CheckpointError, match="cannot save .*extra\\['bad'\\]"):
        pm.save(tmp_path / "other", extra={"bad": object()})
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()

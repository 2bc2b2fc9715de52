"""The capture cache is data: a planted entry runs no code and is a miss; a folder or an entry that
another user owns or may write is not used (one warning); the folder is made owner-only."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest

from autopar.capture import cache as capture_cache
from autopar.capture import graph_codec
from autopar.plans import planning

SPEC = "mlp:layers=2"
PACKAGE = Path(__file__).resolve().parents[3] / "autopar"


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv(capture_cache.SWITCH_ENV, "1")
    monkeypatch.setenv(capture_cache.DIR_ENV, str(tmp_path / "cache"))
    capture_cache._warned.clear()
    return tmp_path / "cache" / "captures"


class Exploit:
    """A pickle that runs code when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def stored_entry(cache_dir: Path) -> Path:
    planning.capture_for_planning(SPEC)
    (entry,) = cache_dir.glob(f"*{capture_cache.ENTRY_SUFFIX}")
    return entry


def test_a_planted_pickle_runs_nothing_and_planning_goes_on(cache_on, tmp_path):
    entry = stored_entry(cache_on)
    marker = tmp_path / "MARKER"
    for path in (entry, entry.with_suffix(".pkl")):  # the entry's name, and the old format's
        path.write_bytes(pickle.dumps(Exploit(marker)) + pickle.dumps(Exploit(marker)))
    plan = planning.plan(SPEC, cluster="cpu:procs=2", global_batch=8)
    assert plan.num_devices == 2 and not marker.exists()


def _header(entry: Path) -> str:
    return entry.read_text().split("\n", 1)[0]


def _graph_json(entry: Path) -> dict:
    return json.loads(entry.read_text().split("\n", 1)[1])


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


PLANTED = {
    "a class name in place of a row": lambda graph: {**graph, "graph": {"class": "os.system", "args": ["touch"]}},
    "an unknown argument tag": lambda graph: _with_first_node_args(graph, [{"pickle": "gASV"}]),
    "a string where a number goes": lambda graph: _with_table_row(graph, "TensorMeta", 0, [["1"], "float32", []]),
    "a huge integer": lambda graph: _with_table_row(graph, "TensorMeta", 0, [[10**30], "float32", []]),
    "a table index out of range": lambda graph: _with_table_row(graph, "Kernel", 0, None),
    "arguments nested too deep": lambda graph: _with_first_node_args(graph, _nested(200)),
    "a row of the wrong length": lambda graph: {**graph, "graph": graph["graph"][:-1]},
}


def _with_first_node_args(graph: dict, args) -> dict:
    nodes = graph["graph"][0]
    nodes[0] = [*nodes[0][:4], args, *nodes[0][5:]]
    return graph


def _with_table_row(graph: dict, table: str, index: int, row) -> dict:
    rows = graph["tables"][table]
    if row is None:
        graph["tables"][table] = []
    else:
        rows[index] = row
    return graph


@pytest.mark.parametrize("damage", PLANTED.values(), ids=list(PLANTED))
def test_a_planted_json_entry_is_a_miss(cache_on, damage):
    entry = stored_entry(cache_on)
    expected = planning.capture_for_planning(SPEC)
    entry.write_text(_header(entry) + "\n" + json.dumps(damage(_graph_json(entry))))
    with pytest.raises(graph_codec.CodecError):
        graph_codec.decode(entry.read_text().split("\n", 1)[1])
    assert capture_cache.lookup(_key()) is None
    assert planning.capture_for_planning(SPEC) == expected  # captured again, and stored again
    assert capture_cache.lookup(_key()) == expected


def _key():
    from autopar.models import resolve_spec

    return capture_cache.spec_key(resolve_spec(SPEC), loss_fn=None, example_targets=None, precision="bf16",
                                  reuse_blocks=True)


def test_json_with_python_constants_or_deep_arrays_is_refused():
    for text in ('{"format": NaN}', "[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}"):
        with pytest.raises(graph_codec.CodecError):
            graph_codec.decode(text)


def test_the_folder_is_made_owner_only(cache_on):
    stored_entry(cache_on)
    assert cache_on.stat().st_mode & 0o777 == 0o700
    (entry,) = cache_on.glob("*.json")
    assert entry.stat().st_mode & 0o077 == 0


def test_a_folder_others_may_write_is_not_used(cache_on, capsys):
    stored_entry(cache_on)
    cache_on.chmod(0o777)
    try:
        assert capture_cache.lookup(_key()) is None
        assert capture_cache.lookup(_key()) is None
        err = capsys.readouterr().err
        assert err.count("the capture cache does not use") == 1  # one warning, not one per lookup
        assert "others may write it" in err and f"chmod go-w {cache_on}" in err
        assert planning.plan(SPEC, cluster="cpu:procs=2", global_batch=8).num_devices == 2
    finally:
        cache_on.chmod(0o700)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_an_entry_of_another_user_is_not_used(cache_on, capsys):
    entry = stored_entry(cache_on)
    os.chown(entry, 12345, 12345)
    assert capture_cache.lookup(_key()) is None
    err = capsys.readouterr().err
    assert "belongs to another user (uid 12345)" in err and capture_cache.DIR_ENV in err


def test_graphs_round_trip_exactly():
    for spec in (SPEC, "gpt:layers=3,hidden=64,heads=4,seq=32,vocab=128",
                 "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,seq=32,vocab=128"):
        graph = planning.capture_for_planning(spec)
        assert graph_codec.decode(graph_codec.encode(graph)) == graph


ALLOWED_UNPICKLING = {
    "tune/launch.py": "results of spawned workers, read back from a private temporary folder autopar made",
    "solver/parallel_search.py": "checks in memory that a worker's exception pickles (nothing read from disk)",
}


def test_nothing_unpickles_data_from_a_path_a_user_can_name():
    found = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if re.search(r"pickle\.loads?\(|torch\.load\(", path.read_text())}
    assert found <= set(ALLOWED_UNPICKLING), sorted(found - set(ALLOWED_UNPICKLING))

"""capture_cache.py: planning captures stored and loaded again, never stale.

conftest.py points the cache at a temporary folder and turns it off for the suite; each test
here turns it on in a folder of its own. A hit is proven by making the capture itself fail.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from unittest import mock

import pytest
import torch
from torch import nn

from autopar import api
from autopar.plans import planning
from autopar.capture import cache as capture_cache
from autopar.cli import main

SPEC = "mlp:layers=2"
MODEL_FILE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x)) {operation}


class Stack(nn.Module):
    def __init__(self, width=16, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()
'''


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv(capture_cache.SWITCH_ENV, "1")
    monkeypatch.setenv(capture_cache.DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "captures"


def no_capture():
    """Patch under which any real capture fails: what runs under it came from the cache."""
    return mock.patch.object(planning, "_capture_replica", side_effect=AssertionError("captured instead of cached"))


def counting_captures():
    return mock.patch.object(planning, "_capture_replica", wraps=planning._capture_replica)


@pytest.mark.parametrize("spec", [SPEC, "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128"])  # gpt: blocks reused
def test_a_hit_gives_the_same_graph_without_capturing(cache_on, capsys, spec):
    first = api.capture_for_planning(spec)
    assert len(list(cache_on.glob("*.json"))) == 1
    with no_capture():
        second = api.capture_for_planning(spec, verbose=True)
    assert second == first  # every node, parameter, block and segment
    assert second.fingerprint() == first.fingerprint()
    assert "loaded from the capture cache" in capsys.readouterr().err


def test_other_requests_miss(cache_on):
    api.capture_for_planning(SPEC)
    with counting_captures() as captured:
        api.capture_for_planning(SPEC, precision="fp32")
        api.capture_for_planning(SPEC, reuse_blocks=False)
        api.capture_for_planning(SPEC.replace("layers=2", "layers=3"))
    assert captured.call_count == 3
    assert len(list(cache_on.glob("*.json"))) == 4


def write_model(path, operation: str):
    path.write_text(textwrap.dedent(MODEL_FILE.format(operation=operation)))


def import_model_file(path):
    spec = importlib.util.spec_from_file_location(f"cache_test_model_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_editing_the_models_source_file_misses(cache_on, tmp_path):
    path = tmp_path / "stack.py"
    write_model(path, "* 2")
    module = import_model_file(path)
    try:
        model, inputs = module.Stack(), (torch.randn(4, 16),)
        first = api.capture_for_planning(model, inputs)
        with no_capture():
            assert api.capture_for_planning(model, inputs) == first
        write_model(path, "* 3")  # the loaded class is unchanged; its file is not
        with counting_captures() as captured:
            api.capture_for_planning(model, inputs)
        assert captured.call_count == 1
    finally:
        sys.modules.pop(module.__name__, None)


def test_a_file_spec_misses_after_its_file_changes(cache_on, tmp_path):
    path = tmp_path / "model_file.py"
    factory = "\n\ndef make():\n    return Stack(), (torch.randn(4, 16),), None, None\n"
    path.write_text(textwrap.dedent(MODEL_FILE.format(operation="* 2")) + factory)
    first = api.capture_for_planning(f"{path}:make")
    with no_capture():
        assert api.capture_for_planning(f"{path}:make") == first
    path.write_text(textwrap.dedent(MODEL_FILE.format(operation="- 1")) + factory)
    second = api.capture_for_planning(f"{path}:make")
    assert second != first  # the subtraction is in the graph now


def test_the_switch_turns_it_off(cache_on, monkeypatch):
    monkeypatch.setenv(capture_cache.SWITCH_ENV, "0")
    api.capture_for_planning(SPEC)
    assert not list(cache_on.glob("*.json"))
    monkeypatch.setenv(capture_cache.SWITCH_ENV, "1")
    api.capture_for_planning(SPEC)
    with counting_captures() as captured:
        api.capture_for_planning(SPEC, cache=False)
        monkeypatch.setenv(capture_cache.SWITCH_ENV, "0")
        api.capture_for_planning(SPEC)
    assert captured.call_count == 2


def test_the_cli_flag_turns_it_off_for_one_command(cache_on, capsys):
    assert main(["graph", SPEC, "--no-capture-cache"]) == 0
    assert not list(cache_on.glob("*.json"))
    assert capture_cache.enabled()  # restored after the command
    assert main(["graph", SPEC]) == 0
    assert len(list(cache_on.glob("*.json"))) == 1
    capsys.readouterr()


def test_a_damaged_entry_is_a_miss(cache_on):
    first = api.capture_for_planning(SPEC)
    (entry,) = cache_on.glob("*.json")
    entry.write_bytes(b"not an entry")
    assert api.capture_for_planning(SPEC) == first
    with no_capture():
        assert api.capture_for_planning(SPEC) == first  # stored again


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def key_of(model, inputs=(torch.zeros(2, 8),), **options):
    return capture_cache.module_key(model, inputs, {}, name="m", loss_fn=None, example_targets=None,
                                    precision=options.get("precision", "bf16"), reuse_blocks=True)


def test_the_key_follows_the_models_state():
    base = key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    assert base == key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))  # values do not matter
    assert base != key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-6)))  # a plain attribute
    assert base != key_of(nn.Sequential(nn.Linear(8, 8, bias=False), nn.LayerNorm(8)))
    assert base != key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), (torch.zeros(3, 8),))
    assert base != key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), (torch.zeros(2, 8, dtype=torch.float64),))
    assert base != key_of(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), precision="fp32")
    shared = nn.Linear(8, 8)
    tied, untied = nn.Sequential(shared, shared), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert key_of(tied) != key_of(untied)
    frozen = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    frozen[0].weight.requires_grad_(False)
    assert base != key_of(frozen)
    constant = nn.Linear(8, 8)
    constant.sizes = torch.tensor([1, 2])  # a plain tensor attribute: its values may shape the trace
    other = nn.Linear(8, 8)
    other.sizes = torch.tensor([1, 3])
    assert key_of(constant) != key_of(other)


def test_what_cannot_be_keyed_is_not_cached(cache_on):
    model = nn.Sequential(nn.Linear(8, 8))
    model.odd = Slotted(3)
    assert key_of(model) is None
    hooked = nn.Linear(8, 8)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        assert key_of(hooked) is None  # a global hook runs in every forward
    finally:
        handle.remove()
    graph = api.capture_for_planning(model, (torch.zeros(2, 8),))
    assert graph.nodes
    assert not list(cache_on.glob("*.json"))


def test_a_changed_installation_misses(cache_on, monkeypatch):
    first = api.capture_for_planning(SPEC)
    listing = capture_cache._distributions(capture_cache._library_dirs())
    monkeypatch.setattr(capture_cache, "_distributions", lambda dirs: listing + ("/site/torch-9.9.dist-info",))
    with counting_captures() as captured:
        assert api.capture_for_planning(SPEC) == first
    assert captured.call_count == 1


def test_the_oldest_entries_are_evicted(cache_on, monkeypatch):
    monkeypatch.setattr(capture_cache, "MAX_ENTRIES", 2)
    for layers in (1, 2, 3):
        api.capture_for_planning(SPEC.replace("layers=2", f"layers={layers}"))
    assert len(list(cache_on.glob("*.json"))) == 2
    assert capture_cache.clear() == 2
    assert not list(cache_on.glob("*.json"))

"""models/meta_build.py: building on meta without running weight initializers."""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn

from autopar import api
from autopar.models import build_model, on_meta, skip_init_on_meta

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


class Counting(nn.Module):
    """Counts how often its initializer runs."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("steps", torch.arange(4))
        nn.init.normal_(self.weight, std=0.02)
        self.scale.data.fill_(1.0)
        Counting.calls += 1


def described(model: nn.Module) -> list:
    return [(name, tuple(t.shape), t.dtype, t.device.type, getattr(t, "requires_grad", None))
            for name, t in [*model.named_parameters(), *model.named_buffers()]]


def test_a_model_built_on_meta_is_the_same_without_its_initializers():
    with mock.patch.object(nn.init, "_no_grad_normal_", wraps=nn.init._no_grad_normal_) as normal:
        with torch.device("meta"):
            initialized = Counting()
        assert normal.call_count == 1
        with on_meta():
            skipped = Counting()
        assert normal.call_count == 1  # not run again
    assert Counting.calls == 2  # the constructors ran
    assert described(skipped) == described(initialized)
    assert all(t.is_meta for t in skipped.parameters())


def test_initializers_still_run_on_real_devices():
    torch.manual_seed(0)
    with skip_init_on_meta():
        layer = nn.Linear(8, 8)
        filled = torch.zeros(3).fill_(2.0)
    assert layer.weight.abs().sum() > 0 and filled.tolist() == [2.0, 2.0, 2.0]
    torch.manual_seed(0)
    assert torch.equal(layer.weight, nn.Linear(8, 8).weight)


def test_built_in_models_built_on_meta_capture_as_the_same_module_built_elsewhere():
    bundle = build_model(SPEC)
    with torch.device("meta"):  # with the initializers
        reference = type(bundle.model)(bundle.config)
    assert described(bundle.model) == described(reference)
    # A spec's model is converted in place; a user's module is copied first: the same graph.
    from_spec = api.capture_for_planning(SPEC)
    from_module = api.capture_for_planning(reference, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                           example_targets=bundle.example_targets)
    assert from_spec.nodes == from_module.nodes and from_spec.params == from_module.params
    assert next(reference.parameters()).dtype == torch.float32  # the user's module is untouched

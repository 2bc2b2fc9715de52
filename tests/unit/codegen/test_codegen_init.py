"""Meta-model init (autopar/codegen/init.py) and checkpoints in one process (world size 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.codegen.init import SeededInit, check_initialised, seeded_init
from autopar.errors import ConfigError

SPEC = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64"


def _llama(device: str):
    from autopar.models import build_model

    return build_model(SPEC, device=device, batch_size=4)


def test_seeded_init_is_per_parameter_and_plan_independent():
    first, second = _llama("cpu").model, _llama("cpu").model
    seeded_init(first, 3)
    torch.manual_seed(99)  # the global RNG plays no part
    seeded_init(second, 3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    other = _llama("cpu").model
    seeded_init(other, 4)
    assert not torch.equal(other.lm_head.weight, first.lm_head.weight)


def test_keyed_generator_ignores_op_order():
    weights = {"a": torch.empty(3), "b": torch.empty(3)}
    with SeededInit(weights, {}, seed=0):
        weights["a"].normal_()
        weights["b"].normal_()
    swapped = {"a": torch.empty(3), "b": torch.empty(3)}
    with SeededInit(swapped, {}, seed=0):
        swapped["b"].normal_()
        swapped["a"].normal_()
    assert torch.equal(weights["a"], swapped["a"]) and torch.equal(weights["b"], swapped["b"])


def test_unset_storage_is_reported():
    with pytest.raises(ConfigError, match="still hold unset values"):
        check_initialised({"w": torch.full((2,), float("nan"))}, {})


def test_meta_model_equals_one_device_and_checkpoints_round_trip(one_process_group, tmp_path):
    import autopar
    from autopar.codegen.checkpoint import CheckpointError

    bundle = _llama("meta")
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    pm = autopar.parallelize(bundle.model, "dgx-a100-80g:gpus_per_node=1", (tokens,), loss_fn=bundle.loss_fn,
                             example_targets=tokens)
    assert all(param.device.type == "meta" for param in bundle.model.parameters()), "the user's model was changed"
    reference = _llama("cpu").model
    seeded_init(reference, 5)
    state = pm.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    loss = pm.train_step((tokens,), tokens)
    assert loss.item() == pytest.approx(bundle.loss_fn(reference(tokens), tokens).item(), abs=1e-5)

    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    optimizer.step()
    pm.save(tmp_path / "ckpt", optimizer=optimizer, extra={"step": 1})
    saved = {name: value.clone() for name, value in pm.state_dict().items()}
    optimizer.step()
    assert pm.load(tmp_path / "ckpt", optimizer=optimizer) == {"step": 1}
    for name, value in pm.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"], "staging folders left behind"

    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        pm.load(tmp_path / "half")


def test_model_without_init_is_refused(one_process_group):
    import autopar

    class NoInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4, device="meta"))

        def forward(self, x):
            return x @ self.weight

    x = torch.randn(2, 4)
    with pytest.raises(ConfigError, match="init_fn"):
        autopar.parallelize(NoInit(), "dgx-a100-80g:gpus_per_node=1", (x,), loss_fn=lambda out, t: out.sum(), example_targets=x)

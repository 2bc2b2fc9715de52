"""pm.steps: the data order by step, resuming from the newest complete checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autopar.codegen.step_data import StepOrder
from autopar.codegen.training_loop import CheckpointPolicy, newest_checkpoint
from autopar.errors import ConfigError


def test_replicas_read_the_global_batch_whatever_their_number():
    order = StepOrder(num_samples=50, global_batch=8, seed=3)
    for step in (0, 5, 6, 13):  # 6 steps per epoch: 6 and 13 are in later epochs
        whole = order.global_indices(step)
        for dp_size in (1, 2, 4, 8):
            shares = [order.rank_indices(step, rank, dp_size) for rank in range(dp_size)]
            assert [index for share in shares for index in share] == whole
    epoch = [index for step in range(6) for index in order.global_indices(step)]
    assert len(set(epoch)) == 48 and order.global_indices(6) != order.global_indices(0)


def test_a_changed_data_order_is_refused():
    order = StepOrder(num_samples=50, global_batch=8)
    with pytest.raises(ConfigError, match="global_batch 4 -> 8"):
        order.check_resumes({**order.position(), "global_batch": 4}, "ckpt/step-2")
    with pytest.raises(ConfigError, match="holds no global batch"):
        StepOrder(num_samples=4, global_batch=8)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        CheckpointPolicy(folder="x", every_steps=0)


def _losses(folder, total_steps: int, dataset) -> list[float]:
    import autopar

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pm = autopar.parallelize(model, "cpu:procs=1", (dataset.tensors[0][:4],), loss_fn=nn.functional.mse_loss,
                             example_targets=dataset.tensors[1][:4], checkpoint=folder, checkpoint_every=2)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = {}
    for step, (inputs, targets) in pm.steps(total_steps, dataset, optimizer=optimizer, scheduler=scheduler):
        losses[step] = pm.train_step((inputs,), targets).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses


def test_a_resumed_loop_goes_on_as_the_uninterrupted_one(one_process_group, tmp_path):
    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(20, 8, generator=generator), torch.randn(20, 4, generator=generator))
    uninterrupted = _losses(tmp_path / "a", 7, dataset)
    assert sorted(uninterrupted) == list(range(1, 8))
    first = _losses(tmp_path / "b", 3, dataset)  # saves step-2 and, as the last, step-3
    (tmp_path / "b" / "step-5.partial").mkdir()  # a save that did not finish: never loaded
    assert newest_checkpoint(tmp_path / "b").name == "step-3"
    resumed = _losses(tmp_path / "b", 7, dataset)
    assert sorted(resumed) == [4, 5, 6, 7]
    for step, loss in {**first, **resumed}.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-6), step
    assert sorted(path.name for path in (tmp_path / "b").glob("step-*")) == ["step-5.partial", "step-6", "step-7"]


def test_a_loop_left_early_publishes_the_save_under_way(one_process_group, tmp_path):
    import autopar

    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(20, 8, generator=generator), torch.randn(20, 4, generator=generator))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pm = autopar.parallelize(model, "cpu:procs=1", (dataset.tensors[0][:4],), loss_fn=nn.functional.mse_loss,
                             example_targets=dataset.tensors[1][:4], checkpoint=tmp_path, checkpoint_every=2)
    for step, (inputs, targets) in pm.steps(10, dataset):
        pm.train_step((inputs,), targets)
        if step == 3:
            break  # step-2's write was started after step 2 and never waited for by the loop
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-2"]
    with pytest.raises(ValueError, match="the body failed"):
        for step, (inputs, targets) in pm.steps(10, dataset):
            if step == 5:
                raise ValueError("the body failed")  # resumed at step 3; step-4's save under way
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-2", "step-4"]


def test_an_iterable_dataset_is_refused_with_what_to_do(one_process_group):
    import autopar
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([])

    model = nn.Sequential(nn.Linear(8, 4))
    pm = autopar.parallelize(model, "cpu:procs=1", (torch.randn(4, 8),), loss_fn=nn.functional.mse_loss,
                             example_targets=torch.randn(4, 4))
    with pytest.raises(ConfigError, match="a Stream has no index: pass a map-style dataset"):
        next(iter(pm.steps(3, Stream())))

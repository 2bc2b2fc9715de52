"""Which samples each step reads, as a function of the step alone, so a resumed job reads on.

The order is global, not per rank: epoch e is a permutation of the dataset drawn from
`seed + e` (or the dataset's order without shuffle), cut into global batches of `global_batch`
samples (an incomplete last batch is dropped), and step s reads global batch s of the sequence
of epochs. A data-parallel rank reads its contiguous share of that batch (`dp_rank` of
`dp_size`), the rows `train_step` gives it when handed the whole batch. The data position is
therefore just the number of steps done: a checkpoint saved by 4 replicas resumes on 2 (or 1)
and every sample of every later step is read exactly once, as in the uninterrupted job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class StepOrder:
    num_samples: int
    """Samples in the dataset (len(dataset))."""
    global_batch: int
    """Samples per step over all data-parallel replicas."""
    shuffle: bool = True
    """Draw each epoch's order from `seed + epoch`; False: the dataset's order every epoch."""
    seed: int = 0
    """Seed of epoch 0's permutation."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.num_samples < self.global_batch:
            raise ConfigError(f"a dataset of {self.num_samples} samples holds no global batch of "
                              f"{self.global_batch}: pass a larger dataset or a smaller global batch")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def global_indices(self, step: int) -> list[int]:
        """The dataset indices of step `step`'s global batch (step 0 is the first)."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        start = batch * self.global_batch
        return self.epoch_order(epoch)[start:start + self.global_batch].tolist()

    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """This data-parallel rank's share of step `step`'s global batch."""
        if self.global_batch % dp_size:
            raise ConfigError(f"a global batch of {self.global_batch} does not split over {dp_size} "
                              "data-parallel replicas: choose a global batch divisible by the replicas")
        share = self.global_batch // dp_size
        return self.global_indices(step)[dp_rank * share:(dp_rank + 1) * share]

    def position(self) -> dict:
        """What a checkpoint records to check that a resumed job reads the same order."""
        return {"num_samples": self.num_samples, "global_batch": self.global_batch, "shuffle": self.shuffle,
                "seed": self.seed}

    def check_resumes(self, saved: dict, source: str) -> None:
        mine = self.position()
        differs = [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in mine.items() if saved.get(key) != value]
        if differs:
            raise ConfigError(f"{source} was saved reading another data order ({', '.join(differs)}): resume with "
                              "the same dataset, global batch, shuffle and seed, or start a new checkpoint folder")

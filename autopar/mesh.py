"""Logical device meshes laid over a cluster.

A mesh has named axes (e.g. ("pp", "dp", "tp")) and is laid out row-major over the ranks, the
last axis fastest: with tp last, a tensor-parallel group is a run of consecutive ranks, i.e.
inside one node when it fits. The layout decides which links an axis' collectives cross.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model.comm import Group


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Named axes over `prod(shape)` devices of a cluster with `devices_per_node` per node."""

    axis_names: tuple[str, ...]
    """e.g. ("dp", "tp")."""
    shape: tuple[int, ...]
    """Devices along each axis."""
    devices_per_node: int
    """Of the cluster the mesh is laid on."""

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"mesh axes {self.axis_names} and shape {self.shape} differ in length")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be unique, got {self.axis_names}")
        if any(size < 1 for size in self.shape):
            raise ValueError(f"mesh sizes must be >= 1, got {self.shape}")

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        return self.axis_names.index(name)

    def size(self, name: str) -> int:
        return self.shape[self.axis(name)] if name in self.axis_names else 1

    def group(self, axis: int) -> Group:
        """The devices one collective on `axis` involves: how many nodes, how many per node."""
        size = self.shape[axis]
        stride = math.prod(self.shape[axis + 1:])
        if stride >= self.devices_per_node:
            return Group(num_nodes=size, devices_per_node=1)
        per_node = max(1, min(size, self.devices_per_node // stride))
        return Group(num_nodes=math.ceil(size / per_node), devices_per_node=per_node)

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.shape))

"""Collective communication time: an alpha-beta model per link level (NCCL-style rings).

A group of n devices spanning k nodes with g devices on each (n = k g). On rail-optimised
clusters (one NIC per GPU) NCCL runs g rings in parallel, each crossing the node boundaries on
its own NIC, so a multi-node group moves data at min(bw_intra, g bw_inter) per device and a
group with one device per node at bw_inter (this reproduces the 300-340 GB/s all-reduce bus
bandwidth that nccl-tests report on 2 x 8 H100). With B the message size:

    all_reduce      2(n-1)/n B / bw          (B: the tensor)
    all_gather      (n-1)/n B / bw           (B: the gathered tensor)
    reduce_scatter  (n-1)/n B / bw           (B: the input tensor)
    all_to_all      (n-1)/n B / bw           (B: the per-device buffer)
    broadcast       B / bw
    send_recv       B / bw                   (bw of the link between the two devices)

plus latency: alpha x steps, with 2(n-1) ring steps for all-reduce or 2 log2(n) + 2 for a tree,
whichever is smaller, and n-1 for the others; alpha of the slowest level crossed. bw is the
link bandwidth x efficiency, or fitted from a profile per collective and level; for a group size
the profile measured, its measurements are interpolated directly (log-log in the message size).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

from cost_model.hardware import LinkSpec
from cost_model.profile import HardwareProfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


class ClusterLike(Protocol):
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    profile: HardwareProfile | None


@dataclass(frozen=True, kw_only=True)
class Group:
    """Shape of a communicating group: `devices_per_node` devices on each of `num_nodes` nodes."""

    num_nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """alpha-beta of one collective on one link level."""

    latency_s: float
    bandwidth_bytes_per_s: float


class CommModel:
    """Prices collectives on a cluster (link specs, refined by a profile's measurements)."""

    def __init__(self, cluster: ClusterLike) -> None:
        self.cluster = cluster
        self.fits = _fit_profile(cluster.profile) if cluster.profile is not None else {}
        self.tables = _measured_tables(cluster.profile) if cluster.profile is not None else {}

    def link(self, op: str, level: str) -> LinkFit:
        fitted = self.fits.get((op, level)) or self.fits.get(("all_reduce", level))
        if fitted is not None:
            return fitted
        spec = self.cluster.intra_node if level == "intra_node" else self.cluster.inter_node
        return LinkFit(latency_s=spec.latency_s, bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s * spec.efficiency)

    def bandwidth_bytes_per_s(self, op: str, group: Group) -> float:
        intra, inter = self.link(op, "intra_node"), self.link(op, "inter_node")
        if group.num_nodes <= 1:
            return intra.bandwidth_bytes_per_s
        if group.devices_per_node <= 1:
            return inter.bandwidth_bytes_per_s
        return min(intra.bandwidth_bytes_per_s, group.devices_per_node * inter.bandwidth_bytes_per_s)

    def time_s(self, op: str, message_bytes: float, group: Group) -> float:
        """Time of one collective; `message_bytes` as in the module docstring."""
        if op not in COLLECTIVES:
            raise ValueError(f"unknown collective '{op}'; known: {', '.join(COLLECTIVES)}")
        n = group.num_devices
        if n <= 1 or message_bytes <= 0:
            return 0.0
        level = "inter_node" if group.num_nodes > 1 else "intra_node"
        volume = volume_factor(op, n) * message_bytes
        table = self.tables.get((op, level, n))
        if table is not None:  # this very group size was profiled: interpolate the measurements
            return _interpolate(table, message_bytes)
        latency = self.link(op, level).latency_s
        return volume / self.bandwidth_bytes_per_s(op, group) + latency_steps(op, n) * latency

    def send_recv_s(self, message_bytes: float, *, crosses_nodes: bool) -> float:
        group = Group(num_nodes=2, devices_per_node=1) if crosses_nodes else Group(num_nodes=1, devices_per_node=2)
        return self.time_s("send_recv", message_bytes, group)


def latency_steps(op: str, num_devices: int) -> int:
    """Message rounds: ring or tree all-reduce (the fewer), log2 n broadcast, n-1 otherwise."""
    n = num_devices
    if op == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)) + 2)
    if op == "broadcast":
        return math.ceil(math.log2(n))
    if op == "send_recv":
        return 1
    return n - 1


def volume_factor(op: str, num_devices: int) -> float:
    """Bytes each device sends per byte of `message_bytes` in a flat ring of n devices."""
    n = num_devices
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n, "broadcast": 1.0, "send_recv": 1.0}[op]


def _measured_tables(profile: HardwareProfile) -> dict[tuple, tuple[list[float], list[float]]]:
    """(op, level, group size) -> measured (message bytes, seconds), sorted by size."""
    points: dict[tuple, list[tuple[float, float]]] = {}
    for point in profile.collectives:
        points.setdefault((point.op, point.level, point.num_devices), []).append((point.message_bytes, point.time_s))
    return {key: ([b for b, _ in sorted(rows)], [t for _, t in sorted(rows)])
            for key, rows in points.items() if len(rows) >= 2}


def _interpolate(table: tuple[list[float], list[float]], message_bytes: float) -> float:
    """Log-log between measured sizes; below the smallest its time (latency-bound), above the
    largest its time scaled with the bytes (bandwidth-bound)."""
    sizes, times = table
    if message_bytes <= sizes[0]:
        return times[0]
    if message_bytes >= sizes[-1]:
        return times[-1] * message_bytes / sizes[-1]
    index = bisect.bisect_right(sizes, message_bytes)
    x0, x1 = math.log(sizes[index - 1]), math.log(sizes[index])
    y0, y1 = math.log(times[index - 1]), math.log(times[index])
    return math.exp(y0 + (y1 - y0) * (math.log(message_bytes) - x0) / (x1 - x0))


def _fit_profile(profile: HardwareProfile) -> dict[tuple, LinkFit]:
    """Alpha-beta fits from measurements, by (collective, level), for the group sizes the profile
    did not measure. Each minimises the *relative* error, so small messages count as much as large
    ones."""
    samples: dict[tuple, list[tuple[float, float, float]]] = {}
    for point in profile.collectives:
        n = point.num_devices
        steps = latency_steps(point.op, n)
        volume = volume_factor(point.op, n) * point.message_bytes
        samples.setdefault((point.op, point.level), []).append((steps, volume, point.time_s))
    fits = {}
    for key, rows in samples.items():
        fit = _least_squares(rows)
        if fit is not None:
            fits[key] = fit
    return fits


def _least_squares(rows: list[tuple[float, float, float]]) -> LinkFit | None:
    """Non-negative fit of t = a s + v / bw over rows (s, v, t), weighting each row by 1/t."""
    if len(rows) < 2:
        return None
    weighted = [(s / t, v / t, 1.0) for s, v, t in rows if t > 0]
    sxx = sum(s * s for s, _, _ in weighted)
    syy = sum(v * v for _, v, _ in weighted)
    sxy = sum(s * v for s, v, _ in weighted)
    sxt = sum(s * t for s, _, t in weighted)
    syt = sum(v * t for _, v, t in weighted)
    det = sxx * syy - sxy * sxy
    if det <= 0:
        return None
    alpha = (sxt * syy - syt * sxy) / det
    inverse_bw = (sxx * syt - sxy * sxt) / det
    if alpha < 0:  # refit through the origin in latency
        alpha, inverse_bw = 0.0, syt / syy
    if inverse_bw <= 0:
        return None
    return LinkFit(latency_s=alpha, bandwidth_bytes_per_s=1.0 / inverse_bw)

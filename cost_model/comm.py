"""Collective communication time: the collective library's protocols on an alpha-beta model per
link level (NCCL-style rings and trees).

A group of n devices spanning k nodes with g devices on each (n = k g). On rail-optimised
clusters (one NIC per GPU) NCCL runs g rings in parallel, each crossing the node boundaries on
its own NIC, so a multi-node group moves large messages at a bus bandwidth of min(bw_intra,
g bw_inter) per device and a group with one device per node at bw_inter (this reproduces the
300-340 GB/s all-reduce bus bandwidth that nccl-tests report on 2 x 8 H100). bw is the link
bandwidth x efficiency. With B the message size, the bytes each device moves are

    all_reduce      2(n-1)/n B          (B: the tensor; a tree all-reduce moves 2 B)
    all_gather      (n-1)/n B           (B: the gathered tensor)
    reduce_scatter  (n-1)/n B           (B: the input tensor)
    all_to_all      (n-1)/n B           (B: the per-device buffer; across nodes the (n-g)/n
                                         sent to other nodes goes through the device's own
                                         network link: all_to_all_bus_bandwidth)
    broadcast       B
    send_recv       B                   (over the link between the two devices)

**Achieved bandwidth against message size and group span.** On GPU systems (a cluster with a
`CollectiveSpec`, cost_model/hardware.py) the time is the fastest of the ways NCCL's tuner
chooses among, each latency + bytes / bandwidth:

    ring, protocol p    base_p + (steps - inter) x intra step_p + inter x inter step_p
                        + bytes / (bus bw x fraction_p, capped)
    tree (all-reduce    base_p + 2 ((g-1) intra step_p + log2(k) lone step_p)
    across nodes)       + 2 B / (bus bw x fraction_p x 0.92)

A ring has n-1 steps (2(n-1) for all-reduce) of which k-1 (2(k-1)) cross nodes; each step moves
the per-rank chunk B/n, so the achieved bus bandwidth is bw_p x c / (c + step latency x bw_p) for
a chunk c: it falls as the group grows at a fixed message (FSDP's per-block gathers over a dp
axis that spans many nodes) and with every network step (14 us for Simple, 5-8.5 us for LL/LL128
when each node holds one rank of the group, as a dp axis with tp inside the node does). The
protocols trade latency for bandwidth: LL (half the bandwidth, capped, sub-microsecond steps on
NVLink) wins small messages, LL128 (0.92) the middle, Simple (full bandwidth, the longest steps)
large ones; a ring across nodes pays at least one proxy post per step (three for Simple), and
Simple's multi-node ring all-reduce latency is x1.4 (NCCL's "plateau effect"). The figures are
NCCL's own tuning-model constants per GPU generation and host (hardware.py), not fitted here.

Without a CollectiveSpec (gloo on CPUs) it is the plain alpha-beta model: alpha x steps, with
2(n-1) ring steps for all-reduce or 2 log2(n) + 2 for a tree, whichever is smaller, log2 n for
broadcast and n-1 for the others; alpha of the slowest level crossed.

A profile overrides both: where it fitted an alpha-beta line per collective and link level, that
line is the model for group sizes it did not measure (the measured curve already holds whatever
protocol the library chose); for a group size it measured, its measurements are interpolated
directly (log-log in the message size).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

from cost_model.hardware import CollectiveSpec, LinkSpec
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


@dataclass(frozen=True, kw_only=True)
class Way:
    """One way to run a collective on a group (an algorithm and a protocol): its time is
    latency + message bytes x volume / bandwidth."""

    name: str
    """e.g. "ring/LL128", "tree/Simple", or "alpha-beta" without protocol terms."""
    latency_s: float
    """Launch plus every step's latency."""
    volume_per_byte: float
    """Bytes each device moves per byte of the message."""
    bus_bandwidth_bytes_per_s: float
    """The rate those bytes move at."""

    def time_s(self, message_bytes: float) -> float:
        return self.latency_s + message_bytes * self.volume_per_byte / self.bus_bandwidth_bytes_per_s


class CommModel:
    """Prices collectives on a cluster (link specs and the library's protocols, refined by a
    profile's measurements)."""

    def __init__(self, cluster: ClusterLike) -> None:
        self.cluster = cluster
        self.collectives: CollectiveSpec | None = getattr(cluster, "collectives", None)
        self.fits = _fit_profile(cluster.profile) if cluster.profile is not None else {}
        self.tables = _measured_tables(cluster.profile) if cluster.profile is not None else {}
        self._ways: dict[tuple[str, int, int], tuple[Way, ...]] = {}

    def link(self, op: str, level: str) -> LinkFit:
        fitted = self.fits.get((op, level)) or self.fits.get(("all_reduce", level))
        if fitted is not None:
            return fitted
        spec = self.cluster.intra_node if level == "intra_node" else self.cluster.inter_node
        return LinkFit(latency_s=spec.latency_s, bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s * spec.efficiency)

    def bandwidth_bytes_per_s(self, op: str, group: Group) -> float:
        """Bus bandwidth of large messages (the Simple protocol's, on NCCL systems)."""
        intra, inter = self.link(op, "intra_node"), self.link(op, "inter_node")
        if group.num_nodes <= 1:
            return intra.bandwidth_bytes_per_s
        if op == "all_to_all":
            return all_to_all_bus_bandwidth(group, intra.bandwidth_bytes_per_s, inter.bandwidth_bytes_per_s)
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
        if self.tables:
            level = "inter_node" if group.num_nodes > 1 else "intra_node"
            table = self.tables.get((op, level, n))
            if table is not None:  # this very group size was profiled: interpolate the measurements
                return _interpolate(table, message_bytes)
        return min(way.time_s(message_bytes) for way in self.ways(op, group))

    def choice(self, op: str, message_bytes: float, group: Group) -> Way:
        """The way the library runs this collective (the fastest of `ways`)."""
        return min(self.ways(op, group), key=lambda way: way.time_s(message_bytes))

    def bus_bandwidth_bytes_per_s(self, op: str, message_bytes: float, group: Group) -> float:
        """Achieved bus bandwidth as nccl-tests reports it: message bytes x the ring's volume
        factor / time."""
        time_s = self.time_s(op, message_bytes, group)
        return message_bytes * volume_factor(op, group.num_devices) / time_s if time_s > 0 else 0.0

    def ways(self, op: str, group: Group) -> tuple[Way, ...]:
        """Every way the library may run `op` on `group` (cached per group shape)."""
        key = (op, group.num_nodes, group.devices_per_node)
        ways = self._ways.get(key)
        if ways is None:
            ways = self._ways[key] = self._compute_ways(op, group)
        return ways

    def _compute_ways(self, op: str, group: Group) -> tuple[Way, ...]:
        n = group.num_devices
        level = "inter_node" if group.num_nodes > 1 else "intra_node"
        fitted = (op, level) in self.fits or ("all_reduce", level) in self.fits
        bus = self.bandwidth_bytes_per_s(op, group)
        if self.collectives is None or fitted:
            latency = latency_steps(op, n) * self.link(op, level).latency_s
            return (Way(name="alpha-beta", latency_s=latency, volume_per_byte=volume_factor(op, n),
                        bus_bandwidth_bytes_per_s=bus),)
        return _protocol_ways(op, group, bus, self.collectives, self.cluster.intra_node, self.cluster.inter_node)

    def send_recv_s(self, message_bytes: float, *, crosses_nodes: bool) -> float:
        group = Group(num_nodes=2, devices_per_node=1) if crosses_nodes else Group(num_nodes=1, devices_per_node=2)
        return self.time_s("send_recv", message_bytes, group)


def _protocol_ways(op: str, group: Group, bus_bytes_per_s: float, spec: CollectiveSpec, intra: LinkSpec,
                   inter: LinkSpec) -> tuple[Way, ...]:
    """Ring (and, for all-reduce across nodes, tree) with each protocol the library would use."""
    nodes, per_node = group.num_nodes, group.devices_per_node
    n = nodes * per_node
    steps, inter_steps = ring_steps(op, n, nodes)
    node_class = 0 if nodes == 1 else 1 if nodes == 2 else 2
    ways = []
    for protocol in spec.protocols:
        if nodes > 1 and not protocol.across_nodes:
            continue
        bandwidth = min(bus_bytes_per_s * protocol.bandwidth_fraction,
                        protocol.max_bus_bandwidth_bytes_per_s[node_class])
        intra_step = protocol.intra_hop_fraction * intra.latency_s
        if nodes > 1:  # a ring that leaves the node waits on the network proxy at every step
            intra_step = max(intra_step, protocol.proxy_steps * spec.proxy_overhead_s)
        lone_step = protocol.lone_inter_hop_fraction * inter.latency_s
        inter_step = lone_step if per_node == 1 else protocol.inter_hop_fraction * inter.latency_s
        latency = protocol.launch_latency_s + (steps - inter_steps) * intra_step + inter_steps * inter_step
        if op == "all_reduce" and nodes > 1:
            latency *= protocol.multi_node_all_reduce_latency_factor
        ways.append(Way(name=f"ring/{protocol.name}", latency_s=latency, volume_per_byte=volume_factor(op, n),
                        bus_bandwidth_bytes_per_s=bandwidth))
        if op == "all_reduce" and nodes > 1:
            tree_latency = protocol.launch_latency_s + 2 * ((per_node - 1) * intra_step
                                                            + math.ceil(math.log2(nodes)) * lone_step)
            ways.append(Way(name=f"tree/{protocol.name}", latency_s=tree_latency, volume_per_byte=2.0,
                            bus_bandwidth_bytes_per_s=bandwidth * spec.tree_bandwidth_fraction))
    return tuple(ways)


def all_to_all_bus_bandwidth(group: Group, intra_bytes_per_s: float, inter_bytes_per_s: float) -> float:
    """An all-to-all is not a ring: each device sends 1/n of its buffer straight to every peer,
    the (g-1)/n for the peers of its node over the node's links and the (n-g)/n for the other
    nodes through its own network link (a device's share of the node's NICs), both at once. Its
    bus bandwidth (volume (n-1)/n over the time) is therefore bounded by the network share, not
    by g x the per-device network bandwidth a ring across nodes enjoys."""
    n, g = group.num_devices, group.devices_per_node
    seconds_per_byte = max((g - 1) / n / intra_bytes_per_s, (n - g) / n / inter_bytes_per_s)
    return (n - 1) / n / seconds_per_byte


def ring_steps(op: str, num_devices: int, num_nodes: int) -> tuple[int, int]:
    """(steps of the ring, steps that cross nodes): n-1 and k-1, twice that for all-reduce
    (reduce-scatter then all-gather), one for a send/recv."""
    if op == "send_recv":
        return 1, (1 if num_nodes > 1 else 0)
    factor = 2 if op == "all_reduce" else 1
    return factor * (num_devices - 1), factor * (num_nodes - 1)


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

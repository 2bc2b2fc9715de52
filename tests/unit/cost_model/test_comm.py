"""The collective model: NCCL's protocol choice (LL / LL128 / Simple, ring / tree) on an
alpha-beta model per link level. The figures under test are NCCL's own tuning-model constants
(cost_model/hardware.py cites them) and the large-message bus bandwidths nccl-tests report
(shared/reference/hardware.md); nothing here is fitted to a training run."""

import math
from dataclasses import replace

import pytest

from autopar.cluster import Cluster
from cost_model.comm import CommModel, Group, latency_steps, volume_factor
from cost_model.hardware import GB, CollectiveSpec, ProtocolSpec
from cost_model.profile import SCHEMA_VERSION, CollectivePoint, HardwareProfile, MatmulPoint

NODE = Group(num_nodes=1, devices_per_node=8)


def bus_bandwidth(model: CommModel, op: str, message_bytes: float, group: Group) -> float:
    """nccl-tests convention: bus bandwidth = bytes / time x volume factor."""
    return message_bytes / model.time_s(op, message_bytes, group) * volume_factor(op, group.num_devices)


def test_volume_factors():
    assert volume_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert volume_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert volume_factor("reduce_scatter", 4) == pytest.approx(3 / 4)


def test_intra_node_all_reduce_runs_near_nvlink_rate():
    model = CommModel(Cluster.from_spec("dgx-a100-80g"))
    busbw = bus_bandwidth(model, "all_reduce", 1e9, NODE)
    # 300 GB/s per direction x link efficiency; NCCL reaches about 230-250 GB/s on A100.
    assert 200 * GB < busbw < 300 * GB
    assert model.bus_bandwidth_bytes_per_s("all_reduce", 1e9, NODE) == pytest.approx(busbw)


def test_two_h100_nodes_all_reduce_bus_bandwidth_matches_nccl_tests():
    # shared/reference/hardware.md: about 300-340 GB/s bus bandwidth on 2x8 H100 (inter-node bound).
    model = CommModel(Cluster.from_spec("dgx-h100:nodes=2"))
    busbw = bus_bandwidth(model, "all_reduce", 4e9, Group(num_nodes=2, devices_per_node=8))
    assert 250 * GB < busbw < 360 * GB


def test_crossing_nodes_is_slower_and_latency_bounds_small_messages():
    model = CommModel(Cluster.from_spec("dgx-a100-80g:nodes=4"))
    inside = model.time_s("all_gather", 1e8, NODE)
    across = model.time_s("all_gather", 1e8, Group(num_nodes=8, devices_per_node=1))
    assert across > 5 * inside
    tiny = model.time_s("all_reduce", 8, Group(num_nodes=4, devices_per_node=8))
    assert tiny == pytest.approx(model.time_s("all_reduce", 16, Group(num_nodes=4, devices_per_node=8)), rel=1e-3)
    assert model.time_s("all_reduce", 1e6, Group(num_nodes=1, devices_per_node=1)) == 0.0


def test_time_grows_linearly_with_bytes_for_large_messages():
    model = CommModel(Cluster.from_spec("dgx-h100:nodes=2"))
    group = Group(num_nodes=2, devices_per_node=8)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"):
        small, large = model.time_s(op, 1e9, group), model.time_s(op, 2e9, group)
        assert large == pytest.approx(2 * small, rel=0.02), op
    with pytest.raises(ValueError, match="unknown collective"):
        model.time_s("all_shuffle", 1e6, group)


def test_the_protocol_follows_the_message_size():
    # NCCL trades latency for bandwidth: LL (sub-microsecond NVLink steps, half the bandwidth) for
    # small messages, LL128 (0.92 of it) in the middle, Simple (all of it, 3.4 us steps) for large.
    model = CommModel(Cluster.from_spec("dgx-a100-80g"))
    chosen = [model.choice("all_reduce", size, NODE).name for size in (64e3, 8e6, 1e9)]
    assert chosen == ["ring/LL", "ring/LL128", "ring/Simple"]
    # Each choice is the fastest way, and the time is that way's time.
    for size in (64e3, 8e6, 1e9):
        times = [way.time_s(size) for way in model.ways("all_reduce", NODE)]
        assert model.time_s("all_reduce", size, NODE) == pytest.approx(min(times))


def test_achieved_bandwidth_ramps_with_the_message_size():
    model = CommModel(Cluster.from_spec("dgx-h100"))
    sizes = [2.0**k for k in range(10, 34)]
    busbw = [model.bus_bandwidth_bytes_per_s("all_gather", size, NODE) for size in sizes]
    assert all(a < b for a, b in zip(busbw, busbw[1:]))  # more bytes never lower the rate
    peak = model.bandwidth_bytes_per_s("all_gather", NODE)
    # 1 MiB moves 128 KiB per rank per step: LL, latency-bound, far below the link rate; the
    # largest messages reach it (Simple at the link's large-message efficiency).
    assert busbw[sizes.index(2.0**20)] < 0.25 * peak
    assert busbw[-1] > 0.98 * peak


def test_a_growing_group_shrinks_the_per_rank_chunk_and_the_achieved_bandwidth():
    # A fixed 64 MiB all-gather (an FSDP block) over more and more nodes of 8: each of the n-1
    # ring steps moves 64 MiB / n, so latency takes over as n grows.
    model = CommModel(Cluster.from_spec("dgx-a100-80g:nodes=512"))
    groups = [Group(num_nodes=k, devices_per_node=8) for k in (2, 16, 128, 512)]
    busbw = [model.bus_bandwidth_bytes_per_s("all_gather", 64 * 2**20, group) for group in groups]
    assert all(a > b for a, b in zip(busbw, busbw[1:]))
    assert busbw[-1] < 0.5 * busbw[0]
    # Scaling the message with the group (a fixed per-rank chunk, as ZeRO's shards are) keeps the
    # bandwidth term per step and adds steps: the time grows about linearly with the nodes.
    chunk = 8 * 2**20
    times = [model.time_s("all_gather", chunk * group.num_devices, group) for group in groups]
    assert all(a < b for a, b in zip(times, times[1:]))


def test_one_rank_per_node_pays_a_network_step_for_every_ring_step():
    # 2-D sharding (tp inside the node, dp across nodes): the dp ring of 16 has one rank per node,
    # all 15 steps cross the network, and NCCL prices each with its tree network latency
    # (LL 5 us, LL128 8.5 us, Simple 14 us) instead of a ring's NVLink steps.
    cluster = Cluster.from_spec("dgx-h100:nodes=16")
    model = CommModel(cluster)
    lone, packed = Group(num_nodes=16, devices_per_node=1), Group(num_nodes=2, devices_per_node=8)
    ways = {way.name: way for way in model.ways("all_gather", lone)}
    assert ways["ring/LL"].latency_s == pytest.approx(6.6e-6 + 15 * 5.0e-6)
    assert ways["ring/Simple"].latency_s == pytest.approx(8.4e-6 + 15 * 14e-6)
    # Same 16 ranks, two nodes: 14 of the 15 steps stay on NVLink (at least one proxy post each).
    packed_ways = {way.name: way for way in model.ways("all_gather", packed)}
    assert packed_ways["ring/Simple"].latency_s == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 1 * 14e-6)
    assert model.time_s("all_gather", 4e6, lone) > model.time_s("all_gather", 4e6, packed)


def test_tree_all_reduce_wins_small_messages_across_many_nodes():
    model = CommModel(Cluster.from_spec("dgx-a100-80g:nodes=64"))
    group = Group(num_nodes=64, devices_per_node=8)
    assert model.choice("all_reduce", 1e6, group).name.startswith("tree/")  # 2 log2(64) network steps, not 126
    # On two nodes a large all-reduce stays on the ring, which moves 2(n-1)/n of the bytes at the
    # full bus bandwidth where the tree moves all of them twice at 0.92 of it.
    assert model.choice("all_reduce", 4e9, Group(num_nodes=2, devices_per_node=8)).name == "ring/Simple"
    # Inside one node NCCL's tree is a chain: only rings are offered.
    assert all(way.name.startswith("ring/") for way in model.ways("all_reduce", NODE))


def test_ll128_is_not_used_across_nodes_where_nccl_disables_it():
    # p3.16xlarge's NIC is not behind the GPUs' PCIe switch (NCCL enables LL128 only up to PXB).
    model = CommModel(Cluster.from_spec("p3-16xlarge:nodes=2"))
    assert {way.name for way in model.ways("all_gather", Group(num_nodes=2, devices_per_node=8))} \
        == {"ring/LL", "ring/Simple"}
    assert "ring/LL128" in {way.name for way in model.ways("all_gather", NODE)}


def test_cpu_clusters_keep_the_plain_alpha_beta_model():
    cluster = Cluster.from_spec("cpu:procs=4")
    assert cluster.collectives is None
    model = CommModel(cluster)
    group = Group(num_nodes=1, devices_per_node=4)
    (way,) = model.ways("all_reduce", group)
    link = cluster.intra_node
    expected = latency_steps("all_reduce", 4) * link.latency_s \
        + volume_factor("all_reduce", 4) * 1e6 / (link.bandwidth_bytes_per_s * link.efficiency)
    assert way.name == "alpha-beta" and model.time_s("all_reduce", 1e6, group) == pytest.approx(expected)


def _profile(points: tuple[CollectivePoint, ...]) -> HardwareProfile:
    return HardwareProfile(schema_version=SCHEMA_VERSION, device_kind="cuda", device_name="NVIDIA H100 80GB HBM3",
                           num_processes=8, memory_bytes=80e9, memory_bandwidth_bytes_per_s=3e12,
                           kernel_overhead_s=5e-6, matmul=(MatmulPoint(dtype="bf16", flops=1e12,
                                                                        achieved_flops_per_s=6e14),),
                           collectives=points)


def test_a_profile_overrides_the_protocol_terms():
    # Measured all-gathers on 2 and 4 GPUs of a node: 10 us + bytes / 100 GB/s of bus bandwidth.
    def measured_s(size: float, n: int) -> float:
        return 10e-6 * (n - 1) + (n - 1) / n * size / (100 * GB)
    points = tuple(CollectivePoint(op="all_gather", level="intra_node", num_devices=n, message_bytes=size,
                                   time_s=measured_s(size, n)) for n in (2, 4) for size in (1e5, 1e7, 1e9))
    cluster = replace(Cluster.from_spec("dgx-h100"), profile=_profile(points))
    model = CommModel(cluster)
    # A measured group size: its measurements, interpolated.
    assert model.time_s("all_gather", 1e7, Group(num_nodes=1, devices_per_node=4)) == pytest.approx(measured_s(1e7, 4))
    # Another group size: the fitted line, not NCCL's preset protocols.
    (way,) = model.ways("all_gather", NODE)
    assert way.name == "alpha-beta"
    assert model.time_s("all_gather", 1e8, NODE) == pytest.approx(measured_s(1e8, 8), rel=0.01)
    # Collectives the profile did not measure inside the node still fall back to its all-reduce
    # fit or, without one, to the protocols; across nodes nothing was measured: protocols.
    assert model.ways("all_gather", Group(num_nodes=2, devices_per_node=8))[0].name.startswith("ring/")


def test_a_cluster_file_latency_moves_every_protocol_on_that_link(tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text('preset = "dgx-h100"\nnodes = 16\n[inter_node]\nlatency_us = 28\n')
    slow, preset = CommModel(Cluster.from_spec(str(path))), CommModel(Cluster.from_spec("dgx-h100:nodes=16"))
    lone = Group(num_nodes=16, devices_per_node=1)
    slow_ways = {way.name: way.latency_s for way in slow.ways("all_gather", lone)}
    preset_ways = {way.name: way.latency_s for way in preset.ways("all_gather", lone)}
    # Doubling the network step doubles every protocol's network steps (15 of them).
    assert slow_ways["ring/LL"] - preset_ways["ring/LL"] == pytest.approx(15 * 5.0e-6)
    assert slow_ways["ring/Simple"] - preset_ways["ring/Simple"] == pytest.approx(15 * 14e-6)


def test_every_gpu_preset_has_a_protocol_table_and_prices_every_collective():
    for preset in ("dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h200", "dgx-b200", "p3-16xlarge"):
        model = CommModel(Cluster.from_spec(f"{preset}:nodes=4"))
        assert model.collectives is not None, preset
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"):
            for group in (NODE, Group(num_nodes=4, devices_per_node=8), Group(num_nodes=4, devices_per_node=1)):
                seconds = model.time_s(op, 1e6, group)
                assert math.isfinite(seconds) and seconds > 0, (preset, op, group)


def test_protocol_and_library_figures_are_validated():
    with pytest.raises(ValueError, match="bandwidth_fraction"):
        ProtocolSpec(name="X", launch_latency_s=1e-6, intra_hop_fraction=1, inter_hop_fraction=1,
                     lone_inter_hop_fraction=1, bandwidth_fraction=1.5)
    with pytest.raises(ValueError, match="launch_latency_s"):
        ProtocolSpec(name="X", launch_latency_s=-1, intra_hop_fraction=1, inter_hop_fraction=1,
                     lone_inter_hop_fraction=1, bandwidth_fraction=1)
    with pytest.raises(ValueError, match="at least one protocol"):
        CollectiveSpec(library="none", protocols=(), proxy_overhead_s=0)
    single_node = ProtocolSpec(name="X", launch_latency_s=0, intra_hop_fraction=1, inter_hop_fraction=1,
                               lone_inter_hop_fraction=1, bandwidth_fraction=1, across_nodes=False)
    with pytest.raises(ValueError, match="across nodes"):
        CollectiveSpec(library="lib", protocols=(single_node,), proxy_overhead_s=0)


def test_an_all_to_all_across_nodes_is_bound_by_each_devices_own_network_link():
    """Each device sends (n-g)/n of its buffer to other nodes through its own NIC (50 GB/s on
    DGX H100), not over a ring with g x that bandwidth; inside a node it runs on NVLink."""
    cluster = Cluster.from_spec("dgx-h100:nodes=4")
    model = CommModel(cluster)
    across = Group(num_nodes=4, devices_per_node=8)
    per_device_network = cluster.inter_node.bandwidth_bytes_per_s * cluster.inter_node.efficiency
    busbw = bus_bandwidth(model, "all_to_all", 4e9, across)
    assert busbw <= per_device_network * (31 / 32) / (24 / 32) * 1.001  # (n-1)/n over (n-g)/n of the network link
    assert busbw > 0.7 * per_device_network
    inside = bus_bandwidth(model, "all_to_all", 4e9, NODE)
    assert inside > 4 * busbw
    # A ring across the same nodes (all-gather) still enjoys the node's g links.
    assert bus_bandwidth(model, "all_gather", 4e9, across) > 3 * busbw

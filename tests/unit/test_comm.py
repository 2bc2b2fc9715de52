import pytest

from autopar.cluster import Cluster
from cost_model.comm import CommModel, Group, volume_factor
from cost_model.hardware import GB


def bus_bandwidth(model: CommModel, op: str, message_bytes: float, group: Group) -> float:
    """nccl-tests convention: bus bandwidth = bytes / time x volume factor."""
    return message_bytes / model.time_s(op, message_bytes, group) * volume_factor(op, group.num_devices)


def test_volume_factors():
    assert volume_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert volume_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert volume_factor("reduce_scatter", 4) == pytest.approx(3 / 4)


def test_intra_node_all_reduce_runs_near_nvlink_rate():
    model = CommModel(Cluster.from_spec("dgx-a100-80g"))
    busbw = bus_bandwidth(model, "all_reduce", 1e9, Group(num_nodes=1, devices_per_node=8))
    # 300 GB/s per direction x link efficiency; NCCL reaches about 230-250 GB/s on A100.
    assert 200 * GB < busbw < 300 * GB


def test_two_h100_nodes_all_reduce_bus_bandwidth_matches_nccl_tests():
    # shared/reference/hardware.md: about 300-340 GB/s bus bandwidth on 2x8 H100 (inter-node bound).
    model = CommModel(Cluster.from_spec("dgx-h100:nodes=2"))
    busbw = bus_bandwidth(model, "all_reduce", 4e9, Group(num_nodes=2, devices_per_node=8))
    assert 250 * GB < busbw < 360 * GB


def test_crossing_nodes_is_slower_and_latency_bounds_small_messages():
    model = CommModel(Cluster.from_spec("dgx-a100-80g:nodes=4"))
    inside = model.time_s("all_gather", 1e8, Group(num_nodes=1, devices_per_node=8))
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

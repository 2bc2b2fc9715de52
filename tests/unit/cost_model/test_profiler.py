"""The hardware profiler: one quick 2-process profile of this machine is shared by the tests."""

import json
import os

import pytest
import torch

import cost_model.profiler as profiler
from autopar.cluster import Cluster
from cost_model.comm import CommModel, Group
from cost_model.compute import ComputeModel
from cost_model.errors import CostModelInputError
from cost_model.hardware import cpu_device
from cost_model.profile import COLLECTIVE_OPS, load_profile, profile_from_dict
from cost_model.profiler import ProfileOptions, plan_collectives, run_profile, threads_per_process


@pytest.fixture(scope="module")
def measured(quick_two_process_profile):
    """(profile, progress reports) of a quick profile with 2 gloo processes (tests/conftest.py)."""
    return quick_two_process_profile


@pytest.fixture(scope="module")
def profile(measured):
    return measured[0]


@pytest.fixture
def profile_path(profile, tmp_path):
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def test_quick_profile_reports_progress(measured):
    # How long a quick profile takes is a benchmark's business, not a test's (timings here are noisy).
    _, reports = measured
    fractions = [fraction for _, fraction in reports]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] == 1.0
    assert any("all_reduce" in message for message, _ in reports)


def test_profile_validates_and_round_trips(profile, profile_path):
    assert load_profile(profile_path) == profile
    assert profile_from_dict(json.loads(profile.to_json())) == profile
    assert profile.device_kind == "cpu" and profile.num_processes == 2
    assert profile.device_name.startswith("CPU")
    assert 0 < profile.memory_bytes <= cpu_device(1).memory_bytes / 2 + 1
    # A CPU streams at least 0.5 GB/s and dispatches a tiny op in well under a millisecond.
    assert profile.memory_bandwidth_bytes_per_s > 0.5e9
    assert 0 < profile.kernel_overhead_s < 1e-3


def test_matmul_points_increase_in_flops_with_positive_rates(profile):
    assert "fp32" in profile.dtypes()
    for dtype in profile.dtypes():
        points = [point for point in profile.matmul if point.dtype == dtype]
        flops = [point.flops for point in points]
        assert flops == sorted(flops) and len(set(flops)) == len(flops) >= 3
        assert all(point.achieved_flops_per_s > 0 for point in points)
    # The largest fp32 matmul is not dispatch-bound: over 1 GFLOP/s on any CPU with a BLAS.
    assert max(point.achieved_flops_per_s for point in profile.matmul if point.dtype == "fp32") > 1e9


def test_two_processes_record_every_collective(profile):
    sizes = ProfileOptions(quick=True).resolved().message_sizes_bytes
    for op in COLLECTIVE_OPS:
        points = [point for point in profile.collectives if point.op == op]
        assert len(points) == len(sizes), op
        assert {point.level for point in points} == {"intra_node"}
        assert {point.num_devices for point in points} == {2}
        assert all(point.time_s > 0 for point in points)
        # Sizes are rounded to whole fp32 elements per rank, and nothing else.
        assert [point.message_bytes for point in points] == pytest.approx(sizes, rel=0.01)


def test_compute_model_interpolates_the_profiles_matmul_rates(profile):
    # The prediction for a size between two measured ones is the profile's throughput there,
    # not a datasheet's. (Whether the profile matches a later live matmul depends on the load
    # at both moments, which under `make test`'s two workers is another test's gloo job:
    # benchmarks/cost_model_accuracy.py measures that, interleaved.)
    model = ComputeModel(cpu_device(2), profile)
    size = 384
    flops = 2.0 * size**3
    points = sorted((point for point in profile.matmul if point.dtype == "fp32"), key=lambda point: point.flops)
    below = [point for point in points if point.flops < flops]
    above = [point for point in points if point.flops > flops]
    assert below and above, [point.flops for point in points]
    low, high = below[-1].achieved_flops_per_s, above[0].achieved_flops_per_s
    predicted_rate = flops / model.kernel(flops, 3 * size * size * 4, is_matmul=True, dtype="float32").matmul_s
    assert min(low, high) * (1 - 1e-9) <= predicted_rate <= max(low, high) * (1 + 1e-9)
    # ... and far from the preset's figure it would fall back to without a profile.
    unprofiled = flops / ComputeModel(cpu_device(2), None).kernel(flops, 3 * size * size * 4, is_matmul=True,
                                                                 dtype="float32").matmul_s
    assert predicted_rate != unprofiled


def test_comm_model_from_the_profile_reproduces_the_measured_magnitudes(profile, profile_path):
    cluster = Cluster.from_spec(f"cpu:procs=2,profile={profile_path}")
    assert cluster.profile == profile and cluster.device_kind == "cpu"
    model = CommModel(cluster)
    group = Group(num_nodes=1, devices_per_node=2)
    largest = max(point.message_bytes for point in profile.collectives)
    for point in profile.collectives:
        if point.message_bytes == largest:  # bandwidth-bound points pin the fitted line
            predicted_s = model.time_s(point.op, point.message_bytes, group)
            assert point.time_s / 3 < predicted_s < point.time_s * 3, point


def test_one_process_measures_compute_only_on_all_cores():
    profile = run_profile(ProfileOptions(matmul_sizes=(64, 128), matmul_dtypes=("fp32",), repeats=3,
                                         min_sample_s=0.002, time_budget_s=5))
    assert profile.collectives == () and profile.num_processes == 1
    assert [point.flops for point in profile.matmul] == [2 * 64**3, 2 * 128**3]
    assert f"{threads_per_process('cpu', 1)} torch thread" in profile.device_name


@pytest.fixture
def nothing_may_run(monkeypatch):
    """Fail the test if the profiler starts measuring or spawning."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the profiler started work before validating its options")

    monkeypatch.setattr(profiler, "_measure_compute", forbidden)
    monkeypatch.setattr(profiler, "spawn_collectives", forbidden)


def test_too_many_processes_raise_before_anything_runs(nothing_may_run):
    too_many = (os.cpu_count() or 1) * profiler.CPU_PROCESSES_PER_CORE + 1
    with pytest.raises(CostModelInputError, match="CPU cores"):
        run_profile(ProfileOptions(num_processes=too_many))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_raises_before_anything_runs(nothing_may_run):
    with pytest.raises(CostModelInputError, match="CUDA is not available"):
        run_profile(ProfileOptions(device="cuda"))


def test_more_processes_than_gpus_raise(nothing_may_run, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CostModelInputError, match="1 visible GPUs"):
        run_profile(ProfileOptions(device="cuda", num_processes=2))


def test_torchrun_environment_is_recognised(monkeypatch, nothing_may_run):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "5")
    assert profiler.torchrun_launch() == profiler.Launch(rank=5, world_size=8, local_world_size=4)
    with pytest.raises(CostModelInputError, match="LOCAL_WORLD_SIZE=4"):
        run_profile(ProfileOptions(num_processes=3))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert profiler.torchrun_launch() is None


def test_options_are_checked():
    with pytest.raises(CostModelInputError, match="device"):
        ProfileOptions(device="tpu")
    with pytest.raises(CostModelInputError, match="num_processes"):
        ProfileOptions(num_processes=0)
    with pytest.raises(CostModelInputError, match="dtype"):
        ProfileOptions(matmul_dtypes=("int8",))
    with pytest.raises(CostModelInputError, match="collective"):
        ProfileOptions(collective_ops=("all_shuffle",))
    cuda = ProfileOptions(device="cuda").resolved()
    assert cuda.matmul_sizes[0] == 256 and cuda.matmul_sizes[-1] == 16384
    # fp8 (split accumulation) and fp8_fast where the GPU has FP8 tensor cores
    assert set(cuda.matmul_dtypes) == {"bf16", "fp16", "fp32", "fp8", "fp8_fast"}


def test_multi_node_plan_labels_levels():
    options = ProfileOptions(message_sizes_bytes=(4096,), collective_ops=("all_reduce", "send_recv"))
    cases = plan_collectives(options, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    groups = {(case.op, case.level, case.ranks) for case in cases}
    assert groups == {
        ("all_reduce", "intra_node", (0, 1)), ("all_reduce", "intra_node", (0, 1, 2, 3)),
        ("all_reduce", "inter_node", (0, 4)), ("all_reduce", "inter_node", (0, 4, 8)),
        ("send_recv", "intra_node", (0, 1)), ("send_recv", "inter_node", (0, 4)),
    }
    single_node = plan_collectives(options, [[0, 1]])
    assert {case.level for case in single_node} == {"intra_node"}


def test_a_cpu_profile_has_no_attention_sweep_and_a_gpu_ones_round_trips(profile):
    from dataclasses import replace

    from cost_model.profile import AttentionPoint

    assert profile.attention == ()  # measured on the CPU: attention is priced by its FLOPs there
    points = (AttentionPoint(phase="forward", causal=True, flops=1e12, achieved_flops_per_s=9e14),
              AttentionPoint(phase="backward", causal=False, flops=2e12, achieved_flops_per_s=5e14))
    data = json.loads(replace(profile, attention=points).to_json())
    assert profile_from_dict(data).attention == points
    data["attention"][0]["causal"] = "yes"
    with pytest.raises(CostModelInputError, match=r"attention\[0\]': field 'causal' must be true or false"):
        profile_from_dict(data)
    data["attention"][0].update(causal=True, phase="sideways")
    with pytest.raises(CostModelInputError, match=r"attention\[0\]': field 'phase' must be one of forward, backward"):
        profile_from_dict(data)


def test_grouped_matmuls_are_measured_by_rows_per_expert_and_price_expert_matmuls(profile):
    """torch._grouped_mm runs on the CPU: the sweep records fp32 points by FLOPs per expert, they
    round-trip, and ComputeModel prices a grouped kernel at the measured rate of its expert size."""
    from cost_model.profile_grouped import EXPERTS

    points = [point for point in profile.grouped_matmul if point.dtype == "fp32"]
    assert len(points) >= 2 and all(point.experts == EXPERTS and point.achieved_flops_per_s > 0 for point in points)
    assert [point.flops_per_expert for point in points] == sorted(point.flops_per_expert for point in points)
    assert profile_from_dict(json.loads(profile.to_json())).grouped_matmul == profile.grouped_matmul
    model = ComputeModel(cpu_device(), profile)
    point = points[-1]
    flops = point.flops_per_expert * 64
    assert model.grouped_matmul_s(flops, point.flops_per_expert, "float32") == pytest.approx(
        flops / point.achieved_flops_per_s)


def test_the_grouped_sweep_skips_the_fp8_key_the_matmul_sweep_measures():
    """On GPUs with FP8 tensor cores the matmul sweep's dtypes include "fp8" (torch._scaled_mm):
    the grouped sweep (torch._grouped_mm) measures the plain dtypes among them and skips it."""
    from types import SimpleNamespace

    from cost_model.profile_grouped import measure_grouped_matmuls
    from cost_model.profile_timing import Timer

    options = SimpleNamespace(matmul_dtypes=("fp32", "fp8"), quick=True, warmup=0, repeats=1, min_sample_s=0.0)
    points = measure_grouped_matmuls(Timer("cpu", "wall"), torch.device("cpu"), options, lambda call_s: call_s,
                                     deadline_s=float("inf"))
    assert points and {point.dtype for point in points} == {"fp32"}

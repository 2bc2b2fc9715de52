import json

import pytest

from autopar.cluster import Cluster, parse_cluster
from autopar.errors import ClusterSpecError, ProfileError
from cost_model.hardware import GB, GIB, SYSTEMS, TFLOPS


@pytest.mark.parametrize("preset", sorted(SYSTEMS))
def test_every_preset_parses(preset):
    cluster = Cluster.from_spec(f"{preset}:nodes=2")
    assert cluster.num_nodes == 2
    assert cluster.devices_per_node == 8
    assert cluster.num_devices == 16
    assert cluster.device.memory_bytes > 8 * GIB
    assert cluster.intra_node.bandwidth_bytes_per_s > cluster.inter_node.bandwidth_bytes_per_s


def test_preset_figures_follow_the_datasheets():
    a100 = Cluster.from_spec("dgx-a100-80g").device
    assert a100.peak_flops("bf16") == 312 * TFLOPS
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(2039 * GB)
    h100 = Cluster.from_spec("dgx-h100")
    assert h100.device.peak_flops("bf16") == 989 * TFLOPS
    # NVLink 900 GB/s both directions = 450 GB/s per direction; NDR 400 Gb/s = 50 GB/s per GPU.
    assert h100.intra_node.bandwidth_bytes_per_s == pytest.approx(450 * GB)
    assert h100.inter_node.bandwidth_bytes_per_s == pytest.approx(50 * GB)
    assert Cluster.from_spec("dgx-a100-40g").inter_node.bandwidth_bytes_per_s == pytest.approx(25 * GB)
    # p3.16xlarge: 25 Gb/s per node shared by 8 GPUs.
    assert Cluster.from_spec("p3-16xlarge").inter_node.bandwidth_bytes_per_s == pytest.approx(25e9 / 64)


def test_partial_nodes_and_cpu_procs():
    cluster = Cluster.from_spec("dgx-h100:nodes=2,gpus_per_node=4")
    assert (cluster.num_nodes, cluster.devices_per_node) == (2, 4)
    cpu = Cluster.from_spec("cpu:procs=4")
    assert cpu.num_devices == 4 and cpu.device_kind == "cpu"
    assert Cluster.from_spec(cpu) is cpu
    assert "16 devices" in Cluster.from_spec("dgx-a100-80g:nodes=2").describe()


def test_spec_whitespace_and_fingerprint():
    first = Cluster.from_spec("dgx-a100-80g: nodes = 16")
    second = Cluster.from_spec("dgx-a100-80g:nodes=16")
    assert first.num_devices == 128
    assert first.fingerprint() == second.fingerprint()
    assert first.fingerprint() != Cluster.from_spec("dgx-a100-80g:nodes=8").fingerprint()


@pytest.mark.parametrize("spec, fragment", [
    ("dgx-a100-8g:nodes=2", "did you mean 'dgx-a100-80g'"),
    ("dgx-h100:node=2", "did you mean 'nodes'"),
    ("dgx-h100:nodes=0", "nodes must be >= 1"),
    ("dgx-h100:nodes=-3", "nodes must be >= 1"),
    ("dgx-h100:nodes=two", "nodes must be an integer"),
    ("dgx-h100:gpus_per_node=16", "have 8 GPUs"),
    ("dgx-h100:gpus_per_node=0", "gpus_per_node must be >= 1"),
    ("cpu:procs=0", "procs must be >= 1"),
    ("dgx-h100:procs=4", "'procs' is for the cpu preset"),
    ("dgx-h100:nodes", "is not key=value"),
    ("tpu-v5", "unknown preset 'tpu-v5'"),
])
def test_bad_specs_raise_one_clear_error(spec, fragment):
    with pytest.raises(ClusterSpecError) as error:
        Cluster.from_spec(spec)
    assert fragment in str(error.value)
    assert spec.split(":")[0] in str(error.value)


def test_non_string_spec_is_rejected():
    with pytest.raises(ClusterSpecError, match="spec string"):
        parse_cluster(16)


def test_toml_cluster_overrides_figures(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('preset = "dgx-a100-80g"\nnodes = 4\n[device]\nmemory_gib = 40\nbf16_tflops = 300\n'
                    '[inter_node]\nbandwidth_gbs = 12.5\nlatency_us = 20\n')
    cluster = Cluster.from_spec(str(path))
    assert cluster.num_devices == 32
    assert cluster.device.memory_bytes == 40 * GIB
    assert cluster.device.peak_flops("bf16") == 300 * TFLOPS
    assert cluster.inter_node.bandwidth_bytes_per_s == pytest.approx(12.5 * GB)
    assert cluster.inter_node.latency_s == pytest.approx(20e-6)


@pytest.mark.parametrize("text, fragment", [
    ("nodes = [", "not valid TOML"),
    ('preset = "dgx-h100"\nnodez = 2\n', "did you mean 'nodes'"),
    ('preset = "dgx-h100"\n[device]\nmemory_gb = 2\n', "did you mean 'memory_gib'"),
    ('preset = "dgx-h100"\n[device]\nmemory_gib = -2\n', "device.memory_gib must be positive"),
    ('preset = "dgx-h100"\n[intra_node]\nbandwidth_gbs = "fast"\n', "intra_node.bandwidth_gbs must be a number"),
    ("nodes = 2\n", "set preset"),
])
def test_bad_toml_files(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ClusterSpecError) as error:
        Cluster.from_spec(str(path))
    assert fragment in str(error.value)


def test_missing_toml_file():
    with pytest.raises(ClusterSpecError, match="cannot read cluster file"):
        Cluster.from_spec("does/not/exist.toml")


def _profile_dict(**changes):
    data = {"schema_version": 1, "device_kind": "cpu", "device_name": "CPU (2 cores)", "num_processes": 1,
            "memory_bytes": 8e9, "memory_bandwidth_bytes_per_s": 1e10, "kernel_overhead_s": 1e-5,
            "matmul": [{"dtype": "fp32", "flops": 1e9, "achieved_flops_per_s": 5e10}], "collectives": []}
    data.update(changes)
    return data


def test_cluster_loads_a_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_dict()))
    cluster = Cluster.from_spec(f"cpu:procs=2,profile={path}")
    assert cluster.profile is not None and cluster.profile.device_name == "CPU (2 cores)"


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    (json.dumps(_profile_dict(schema_version=99)), "schema_version is 99"),
    (json.dumps(_profile_dict(memory_bandwidth_bytes_per_s=0)), "memory_bandwidth_bytes_per_s' must be positive"),
    (json.dumps(_profile_dict(device_kind="cuda", device_name="NVIDIA H200")), "measured on cuda"),
    (json.dumps({k: v for k, v in _profile_dict().items() if k != "matmul"}), "missing field 'matmul'"),
])
def test_bad_profiles(tmp_path, content, fragment):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as error:
        Cluster.from_spec(f"cpu:profile={path}")
    assert fragment in str(error.value)
    assert "profile.json" in str(error.value)


def test_profile_of_another_gpu_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_dict(device_kind="cuda", device_name="NVIDIA H200")))
    with pytest.raises(ProfileError, match="not on A100"):
        Cluster.from_spec(f"dgx-a100-80g:profile={path}")
    assert Cluster.from_spec(f"hgx-h200:profile={path}").profile.device_name == "NVIDIA H200"


def test_a_power_cap_scales_the_compute_peaks_by_the_documented_clock_relation(tmp_path):
    from dataclasses import replace

    from cost_model.hardware import H100_NVL_BF16_TFLOPS, H100_NVL_BOARD_POWER_W, H100_SXM_BF16_TFLOPS

    h100 = Cluster.from_spec("dgx-h100").device
    # The relation reproduces the second datasheet part it was derived from (same die, 400 W).
    nvl = replace(h100, peak_flops_per_s={"bf16": H100_SXM_BF16_TFLOPS * TFLOPS}, power_limit_w=H100_NVL_BOARD_POWER_W)
    assert nvl.peak_flops("bf16") == pytest.approx(H100_NVL_BF16_TFLOPS * TFLOPS)
    path = tmp_path / "capped.toml"
    path.write_text('preset = "dgx-h100"\n[device]\npower_limit_w = 500\n')
    capped = Cluster.from_spec(str(path)).device
    fraction = capped.peak_flops("bf16") / h100.peak_flops("bf16")
    assert nvl.clock_fraction < fraction < 1.0  # between the NVL's 400 W and the SXM's 700 W
    assert capped.peak_flops("fp32") / h100.peak_flops("fp32") == pytest.approx(fraction)  # the clock moves all units
    assert capped.memory_bandwidth_bytes_per_s == h100.memory_bandwidth_bytes_per_s  # HBM clock is not capped
    assert replace(h100, power_limit_w=800).peak_flops("bf16") == h100.peak_flops("bf16")  # above TDP: no effect


def test_float8_gemms_run_at_their_documented_speed_up_over_bf16(tmp_path):
    """Hopper's float8 GEMMs ran 1.905x the bf16 ones in Transformer Engine's GEMM profiling guide
    (not the peaks' 2x); a cluster file may state another figure; devices without FP8 emulate."""
    h100 = Cluster.from_spec("dgx-h100").device
    assert h100.fp8_matmul_speedup == pytest.approx(31.968 / 16.785, rel=1e-3)  # the peaks: 1,979 / 989
    assert Cluster.from_spec("hgx-h200").device.fp8_matmul_speedup == pytest.approx(h100.fp8_matmul_speedup)
    assert Cluster.from_spec("dgx-a100-80g").device.fp8_matmul_speedup == 1.0
    path = tmp_path / "fp8.toml"
    path.write_text('preset = "dgx-h100"\n[device]\nfp8_matmul_efficiency = 1.0\n')
    assert Cluster.from_spec(str(path)).device.fp8_matmul_speedup == pytest.approx(2.0, rel=1e-3)
    path.write_text('preset = "dgx-h100"\n[device]\nfp8_matmul_efficiency = 1.5\n')
    with pytest.raises(ClusterSpecError, match="fp8_matmul_efficiency"):
        Cluster.from_spec(str(path))


def test_a_power_cap_without_a_documented_relation_is_refused(tmp_path):
    path = tmp_path / "capped.toml"
    path.write_text('preset = "dgx-a100-80g"\n[device]\npower_limit_w = 300\n')
    with pytest.raises(ClusterSpecError) as error:
        Cluster.from_spec(str(path))
    assert "power_limit_w 300 W needs" in str(error.value) and "clock_power_exponent" in str(error.value)
    path.write_text('preset = "dgx-a100-80g"\n[device]\npower_limit_w = 300\nclock_power_exponent = 0.3\n')
    capped = Cluster.from_spec(str(path)).device  # the user states the relation: priced
    assert capped.peak_flops("bf16") == pytest.approx(312 * TFLOPS * (300 / 400) ** 0.3)


def test_a_cluster_file_names_the_attention_kernel_its_runtime_runs(tmp_path):
    path = tmp_path / "flash2.toml"
    path.write_text('preset = "dgx-h100"\n[device]\nattention_kernel = "flash2"\n')
    assert Cluster.from_spec(str(path)).device.attention.name == "flash2"
    path.write_text('preset = "dgx-a100-80g"\n[device]\nattention_kernel = "flash2"\n')
    with pytest.raises(ClusterSpecError, match="no documented rates"):
        Cluster.from_spec(str(path))


def test_the_b200_preset_carries_its_datasheet_and_h100s_matmul_terms_by_one_measurement():
    """DGX B200: 8 B200s on NVLink 5, 400 Gb/s per GPU between nodes; matmul terms from H100's by the
    maximum achievable matmul both parts measured (cost_model/hardware.py)."""
    cluster, h100 = Cluster.from_spec("dgx-b200:nodes=2"), Cluster.from_spec("dgx-h100").device
    b200 = cluster.device
    assert cluster.num_devices == 16 and cluster.intra_node.bandwidth_bytes_per_s == 900e9
    assert b200.peak_flops("fp8") == 2 * b200.peak_flops("bf16") == 4.5e15
    assert b200.memory_bytes / 2**30 == pytest.approx(179.06, abs=0.01) and b200.sm_count == 148
    assert b200.matmul_efficiency < h100.matmul_efficiency  # 77.6% of peak at best against 80.3%
    assert b200.fp8_matmul_speedup == pytest.approx(3432.5 / 1745.0)
    assert b200.has_fp8 and b200.attention is None  # no kernel documented with all four rates
    assert cluster.collectives.channels == 32

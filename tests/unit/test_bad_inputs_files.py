"""Bad files: cluster TOMLs, plans, profiles and model files, through the CLI.

Each exits 2 with one paragraph naming the file, the field and the fix; none hangs or prints a
traceback, and no long value is echoed back whole.
"""

import json
import pickle
import tempfile
from pathlib import Path

import pytest

from bad_input_harness import FOUR_GPUS, TINY, api_error, cli_error, run_cli
from autopar.errors import PlanMismatchError


@pytest.fixture
def tmp_path():
    """A short folder: messages shorten long paths, and the folders pytest makes under xdist
    (.../popen-gw1/test_bad_cluster_toml_toml0_0/) are long enough to lose the file's name."""
    with tempfile.TemporaryDirectory(prefix="ap-") as folder:
        yield Path(folder)


def plan_with_cluster(path):
    return ["plan", TINY, "--cluster", str(path), "--global-batch", "8"]


# --- cluster TOML files ---------------------------------------------------------------------

TOML_CASES = [
    ('preset = "dgx-h100"\nnodes = 1000000000000\n', ["nodes", "at most"]),
    ('preset = "dgx-h100"\nnodes = 0\n', ["nodes", ">= 1"]),
    ('preset = "dgx-h100"\nnodes = "2"\n', ["nodes", "integer"]),
    ('preset = "dgx-h100"\nnodes = 2.5\n', ["nodes", "integer"]),
    ('preset = "dgx-h100"\nnodes = true\n', ["nodes", "integer"]),
    ('preset = "dgx-h100"\ngpus_per_node = 0\n', ["gpus_per_node", ">= 1"]),
    ('preset = "cpu"\nprocs = 100000000\n', ["procs", "at most"]),
    ('preset = "dgx-h100"\n[inter_node]\nlatency_us = nan\n', ["latency_us", "finite"]),
    ('preset = "dgx-h100"\n[inter_node]\nbandwidth_gbs = inf\n', ["bandwidth_gbs", "finite"]),
    ('preset = "dgx-h100"\n[device]\nmemory_gib = -80\n', ["memory_gib", "positive"]),
    ('preset = "dgx-h100"\n[device]\nmemory_gib = 1e300\n', ["memory_gib", "at most"]),
    ('preset = "dgx-h100"\n[device]\nbf16_tflops = "fast"\n', ["bf16_tflops", "number"]),
    ('preset = "dgx-h100"\n[device]\nname = 42\n', ["device.name", "string"]),
    ('preset = "dgx-h100"\n[device]\nname = ""\n', ["device.name", "empty"]),
    ('preset = "dgx-h100"\n[device]\nmatmul_efficiency = 2\n', ["matmul_efficiency"]),
    ('preset = "dgx-h100"\n[device]\nattention_kernel = "flash9"\n', ["attention_kernel 'flash9'", "flash2"]),
    ('preset = "dgx-h100"\n[device]\nattention_kernel = 2\n', ["device.attention_kernel", "string"]),
    ('preset = "dgx-h100"\n[intra_node]\nefficiency = 0\n', ["efficiency"]),
    ('preset = "dgx-h100"\n[intra_node]\nname = ["a"]\n', ["intra_node.name", "string"]),
    ('preset = "dgx-h100"\n[device]\nspeed = 3\n', ["unknown key 'device.speed'"]),
    ('preset = "dgx-h100"\nnodez = 2\n', ["did you mean 'nodes'"]),
    ('preset = "dgx-h100"\ndevice = 5\n', ["table"]),
    ('nodes = 2\n', ["preset"]),
    ('preset = 42\n', ["preset"]),
    ('preset = "dgx-h1000"\n', ["did you mean"]),
    ('preset = "dgx-h100"\nprofile = 42\n', ["profile", "string"]),
    ('preset = "dgx-h100"\nnodes = 2\nnodes = 3\n', ["not valid toml"]),
    ('preset = "dgx-h100\n', ["not valid toml"]),
    ('preset = "dgx-h100"\n[device]\nname = "' + "n" * 100_000 + '"\n', ["device.name", "at most"]),
]


@pytest.mark.parametrize("text, fragments", TOML_CASES, ids=[f"toml{i}" for i in range(len(TOML_CASES))])
def test_bad_cluster_toml(capsys, tmp_path, text, fragments):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    outcome = cli_error(capsys, plan_with_cluster(path), "cluster.toml", *fragments)
    assert "n" * 1000 not in outcome.err


def test_binary_cluster_toml(capsys, tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_bytes(b"\x80\x81\xfe\xff" * 64)
    cli_error(capsys, plan_with_cluster(path), "cluster.toml", "utf-8")


def test_cluster_toml_is_a_folder(capsys, tmp_path):
    folder = tmp_path / "c.toml"
    folder.mkdir()
    cli_error(capsys, plan_with_cluster(folder), "c.toml", "folder")


def test_missing_cluster_toml(capsys, tmp_path):
    cli_error(capsys, plan_with_cluster(tmp_path / "none.toml"), "cannot read cluster file")


def test_cluster_toml_naming_a_binary_profile(capsys, tmp_path):
    (tmp_path / "prof.json").write_bytes(pickle.dumps({"a": 1}))
    path = tmp_path / "cluster.toml"
    path.write_text('preset = "cpu"\nprocs = 2\nprofile = "prof.json"\n')
    cli_error(capsys, plan_with_cluster(path), "prof.json", "utf-8")


# --- profiles named in cluster specs ------------------------------------------------------------

def valid_profile() -> dict:
    return {"schema_version": 1, "device_kind": "cpu", "device_name": "CPU (test)", "num_processes": 2,
            "memory_bytes": 8e9, "memory_bandwidth_bytes_per_s": 2e10, "kernel_overhead_s": 1e-6,
            "matmul": [{"dtype": "fp32", "flops": 1e6, "achieved_flops_per_s": 1e10}]}


PROFILE_CASES = [
    (lambda p: p.update(schema_version=7), ["schema_version"]),
    (lambda p: p.update(memory_bytes=float("nan")), ["memory_bytes", "finite"]),
    (lambda p: p.update(memory_bytes=float("inf")), ["memory_bytes", "finite"]),
    (lambda p: p.update(memory_bytes=-1), ["memory_bytes", "positive"]),
    (lambda p: p.update(num_processes=2.5), ["num_processes", "integer"]),
    (lambda p: p.update(num_processes=10**30), ["num_processes", "at most"]),
    (lambda p: p.update(device_name=42), ["device_name", "string"]),
    (lambda p: p.update(device_name="d" * 100_000), ["device_name", "at most"]),
    (lambda p: p.update(device_kind="tpu"), ["device_kind"]),
    (lambda p: p.update(matmul=[]), ["matmul", "empty"]),
    (lambda p: p.update(matmul="fast"), ["matmul", "list"]),
    (lambda p: p.update(matmul=[42]), ["matmul[0]", "object"]),
    (lambda p: p.update(matmul=[{"dtype": "fp32", "flops": True, "achieved_flops_per_s": 1e10}]), ["flops"]),
    (lambda p: p.update(collectives=[{"op": "all_reduce", "level": "intra_node", "num_devices": 2,
                                      "message_bytes": 1e6, "time_s": -1}]), ["time_s", "positive"]),
    (lambda p: p.update(collectives=[{"op": "gossip", "level": "intra_node", "num_devices": 2,
                                      "message_bytes": 1e6, "time_s": 1}]), ["gossip"]),
    (lambda p: p.pop("memory_bytes"), ["missing field 'memory_bytes'"]),
    (lambda p: p.update(kernel_overhead_s=-1e-6), ["kernel_overhead_s", ">= 0"]),
]


@pytest.mark.parametrize("mutate, fragments", PROFILE_CASES, ids=[f"profile{i}" for i in range(len(PROFILE_CASES))])
def test_bad_profile_in_cluster_spec(capsys, tmp_path, monkeypatch, mutate, fragments):
    data = valid_profile()
    mutate(data)
    (tmp_path / "prof.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    outcome = cli_error(capsys, plan_with_cluster("cpu:procs=2,profile=prof.json"), "prof.json", *fragments)
    assert "d" * 1000 not in outcome.err


@pytest.mark.parametrize("content, fragments", [
    (pickle.dumps({"schema_version": 1}), ["utf-8"]),
    (b"\x00\x01\x02" * 100, ["not valid json"]),
    (b"[" * 200_000 + b"]" * 200_000, ["nested"]),
    (b"", ["not valid json"]),
])
def test_unreadable_profile_in_cluster_spec(capsys, tmp_path, monkeypatch, content, fragments):
    (tmp_path / "prof.json").write_bytes(content)
    monkeypatch.chdir(tmp_path)
    cli_error(capsys, plan_with_cluster("cpu:procs=2,profile=prof.json"), "prof.json", *fragments)


def test_profile_that_is_a_folder(capsys, tmp_path, monkeypatch):
    (tmp_path / "prof.json").mkdir()
    monkeypatch.chdir(tmp_path)
    cli_error(capsys, plan_with_cluster("cpu:procs=2,profile=prof.json"), "prof.json", "folder")


# --- plans given to `show` (and Plan.load) ---------------------------------------------------

@pytest.fixture(scope="module")
def plan_data():
    import autopar

    return autopar.plan(TINY, cluster=FOUR_GPUS, global_batch=8, constraints={"tp": 2, "pp": 2}).to_dict()


def _set(path: str, value):
    def mutate(data):
        *parents, last = path.split(".")
        target = data
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return mutate


_DELETE = object()

PLAN_CASES = [
    (_set("mesh.tp", -2), ["mesh", "tp", ">= 1"]),
    (_set("mesh.dp", 0), ["mesh", "dp", ">= 1"]),
    (_set("mesh.tp", 3), ["mesh", "num_devices"]),
    (_set("mesh", {"tp": 2, "pp": 2}), ["mesh", "dp"]),
    (_set("mesh", {"tp": 2, "pp": 2, "dp": 1, "zz": 1}), ["mesh", "zz"]),  # an unknown axis (cp is known)
    (_set("mesh", {"tp": 2, "pp": 2, "dp": 1, "cp": 0}), ["mesh", "cp", ">= 1"]),
    (_set("mesh", "2x2"), ["mesh", "object"]),
    (_set("mesh.tp", "2"), ["mesh", "tp", "integer"]),
    (_set("mesh.tp", True), ["mesh", "tp", "integer"]),
    (_set("num_microbatches", 0), ["num_microbatches", ">= 1"]),
    (_set("microbatch_size", -1), ["microbatch_size", ">= 1"]),
    (_set("num_microbatches", 3), ["global_batch"]),
    (_set("global_batch", 8.5), ["global_batch", "integer"]),
    (_set("num_devices", 10**30), ["num_devices", "at most"]),
    (_set("virtual_stages", 0), ["virtual_stages", ">= 1"]),
    (_set("schedule", "zigzag"), ["schedule"]),
    (_set("zero_stage", 7), ["zero_stage"]),
    (_set("stages", []), ["stages"]),
    (_set("stages", "all"), ["stages", "list"]),
    (_set("stages.0", 5), ["stages[0]", "object"]),
    (_set("stages.0.layers", [2, 1]), ["stages[0].layers"]),
    (_set("stages.0.layers", [-1, 1]), ["stages[0].layers"]),
    (_set("stages.0.segments", "prologue"), ["stages[0].segments", "list"]),
    (_set("stages.0.time_per_microbatch_s", float("nan")), ["time_per_microbatch_s", "finite"]),
    (_set("stages.0.memory_bytes", [1]), ["stages[0].memory_bytes", "object"]),
    (_set("stages.0.index", 5), ["stages[0].index"]),
    (_set("predicted.step_time_s", "fast"), ["predicted.step_time_s", "number"]),
    (_set("predicted.step_time_s", -1.0), ["predicted.step_time_s", ">= 0"]),
    (_set("predicted.peak_memory_bytes", float("inf")), ["peak_memory_bytes", "finite"]),
    (_set("predicted.breakdown_s", {"compute": "x"}), ["predicted.breakdown_s", "number"]),
    (_set("predicted", None), ["predicted", "object"]),
    (_set("placements", ["R"]), ["placements", "object"]),
    (_set("placements", {"x": 5}), ["placements", "string"]),
    (_set("param_placements", {"w": "S(0)" * 1}), None),  # valid: not every value is checked by hand
    (_set("model", "m" * 10_000_000), ["model", "at most"]),
    (_set("model", 42), ["model", "string"]),
    (_set("notes", "a note"), ["notes", "list"]),
    (_set("replicated_ops", [["op", "x"]]), ["replicated_ops"]),
    (_set("schema_version", 99), ["schema_version"]),
    (_set("stages", _DELETE), ["stages"]),
    (_set("mesh", _DELETE), ["mesh"]),
    (_set("predicted", _DELETE), ["predicted"]),
    (_set("predicted.step_time_s", _DELETE), ["step_time_s"]),
    (_set("stages.0.layers", _DELETE), ["stages[0]", "layers"]),
    (_set("precision", "fp4"), ["precision"]),
    (_set("cluster", None), ["cluster", "string"]),
]
PLAN_ERROR_CASES = [case for case in PLAN_CASES if case[1] is not None]


@pytest.mark.parametrize("mutate, fragments", PLAN_ERROR_CASES, ids=[f"plan{i}" for i in range(len(PLAN_ERROR_CASES))])
def test_bad_plan_file_in_show(capsys, tmp_path, plan_data, mutate, fragments):
    data = json.loads(json.dumps(plan_data))
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    outcome = cli_error(capsys, ["show", path], "plan.json", *fragments)
    assert "m" * 1000 not in outcome.err
    api_error(lambda: __import__("autopar").Plan.load(path), *fragments, error_type=PlanMismatchError)


def test_unchanged_plan_loads(capsys, tmp_path, plan_data):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_data))
    assert run_cli(capsys, ["show", path]).code == 0


@pytest.mark.parametrize("content, fragments", [
    (pickle.dumps({"mesh": {"tp": 1}}), ["utf-8"]),
    (b"\xff\xfe\x00p\x00l\x00a\x00n", ["utf-8"]),
    (b"[" * 200_000 + b"]" * 200_000, ["nested"]),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, ["nested"]),
    (b"[1, 2, 3]", ["json object"]),
    (b"", ["not valid json"]),
    (b"NaN", ["json object"]),
    (b'{"schema_version": 1}', ["missing"]),
])
def test_unreadable_plan_file(capsys, tmp_path, content, fragments):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    cli_error(capsys, ["show", path], "plan.json", *fragments)


def test_plan_file_is_a_folder(capsys, tmp_path):
    cli_error(capsys, ["show", tmp_path], "folder")


def test_plan_file_name_too_long(capsys):
    cli_error(capsys, ["show", "p" * 5000 + ".json"], "too long")


def test_plan_file_missing(capsys):
    cli_error(capsys, ["show", "no-such-plan.json"], "cannot read plan")


# --- model files (file.py:factory) -------------------------------------------------------------

MODEL_HEADER = "import torch\nfrom torch import nn\n"
FILE_CASES = [
    ("import sys\ndef make():\n    sys.exit(0)\n", ["sys.exit"]),
    ("import sys\ndef make():\n    sys.exit('bye')\n", ["sys.exit"]),
    ("import sys\nsys.exit(3)\ndef make():\n    pass\n", ["sys.exit"]),
    ("import argparse\nargparse.ArgumentParser().parse_args()\ndef make():\n    pass\n", ["sys.exit", "parse_args"]),
    ("import argparse\ndef make():\n    argparse.ArgumentParser().parse_args(['--x'])\n", ["sys.exit", "parse_args"]),
    ("def make():\n    raise RuntimeError('boom')\n", ["boom"]),
    ("def make(:\n", ["SyntaxError"]),
    ("def make():\n    return 42\n", ["returned an int"]),
    (MODEL_HEADER + "def make():\n    return nn.Linear(4, 4), 'hello'\n", ["example_inputs", "str"]),
    (MODEL_HEADER + "def make():\n    return nn.Linear(4, 4), (torch.randn(2, 4),), 'mse'\n", ["loss_fn", "str"]),
    (MODEL_HEADER + "make = 5\n", ["not a function"]),
    (MODEL_HEADER + "def maek():\n    pass\n", ["did you mean 'maek'"]),
    (MODEL_HEADER + "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.fc = nn.Linear(8, 8)\n    def forward(self, x):\n        y = self.fc(x)\n        return y[y > 0]\n"
     "def make():\n    return M(), (torch.randn(4, 8),)\n", ["data-dependent"]),
    (MODEL_HEADER + "def make():\n    return nn.Linear(8, 4), (torch.randn(2, 5),)\n", ["shape", "example_inputs"]),
    (MODEL_HEADER + "def make():\n    return nn.Linear(8, 4), (torch.randn(2, 8),), 'mse', torch.randn(2, 4)\n",
     ["loss_fn", "str"]),
    ("import os\ndef make():\n    raise KeyboardInterrupt\n", ["interrupted"]),
]


def test_forward_that_branches_on_a_value_is_not_called_a_bad_input(capsys, tmp_path):
    """Planning runs the model on meta tensors, where `if y.sum() > 0` cannot be decided: the
    inputs are fine, the forward reads a tensor's value; the message says so, names the line and
    says what to write instead."""
    path = tmp_path / "user_model.py"
    path.write_text(MODEL_HEADER + "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.fc = nn.Linear(8, 8)\n    def forward(self, x):\n        y = self.fc(x)\n"
                    "        if y.sum() > 0:\n            return y * 2\n        return y\n"
                    "def make():\n    return M(), (torch.randn(4, 8),)\n")
    outcome = run_cli(capsys, ["plan", f"{path}:make", "--cluster", "cpu:procs=2", "--global-batch", "4"])
    from bad_input_harness import assert_clear

    assert_clear(outcome, "reads tensor values", "user_model.py:", "if y.sum() > 0:", "torch.where", "torch.cond")
    assert "rejects its example inputs" not in outcome.err and "example_inputs of the shapes" not in outcome.err


@pytest.mark.parametrize("source, fragments", FILE_CASES, ids=[f"file{i}" for i in range(len(FILE_CASES))])
def test_bad_model_file(capsys, tmp_path, source, fragments):
    path = tmp_path / "user_model.py"
    path.write_text(source)
    outcome = run_cli(capsys, ["plan", f"{path}:make", "--cluster", "cpu:procs=2", "--global-batch", "4"])
    if "interrupted" in fragments:
        assert outcome.code == 130 and "Traceback" not in outcome.err
        return
    from bad_input_harness import assert_clear

    assert_clear(outcome, *fragments)
    assert "usage:" not in outcome.err  # the file's own argparse usage is not shown as autopar's


def test_model_file_not_utf8(capsys, tmp_path):
    path = tmp_path / "user_model.py"
    path.write_bytes(b"def make():\n    return '\xff\xfe'\n")
    cli_error(capsys, ["plan", f"{path}:make", "--cluster", "cpu", "--global-batch", "4"], "user_model.py")


def test_model_file_missing(capsys, tmp_path):
    cli_error(capsys, ["plan", f"{tmp_path}/none.py:make", "--cluster", "cpu", "--global-batch", "4"], "not found")


def test_model_file_name_too_long(capsys):
    cli_error(capsys, ["plan", "m" * 5000 + ".py:make", "--cluster", "cpu", "--global-batch", "4"], "too long")


def test_model_file_that_prints_keeps_json_stdout_clean(capsys, tmp_path):
    path = tmp_path / "chatty.py"
    path.write_text(MODEL_HEADER + "print('importing chatty')\n"
                    "def make():\n    print('building')\n    return nn.Linear(8, 4), (torch.randn(4, 8),)\n")
    outcome = run_cli(capsys, ["plan", f"{path}:make", "--cluster", "cpu:procs=2", "--global-batch", "4", "--json"])
    assert outcome.code == 0, outcome.err
    json.loads(outcome.out)  # one JSON object, the file's prints are not in it
    assert "importing chatty" in outcome.err and "building" in outcome.err

"""The cluster a plan is made for: nodes, devices per node, the device, two link levels.

A cluster is written as a spec string, used alike by the API and the CLI:

    dgx-a100-80g:nodes=16
    dgx-h100:nodes=2,gpus_per_node=4
    cpu:procs=4,profile=profile.json
    path/to/cluster.toml

A TOML file names a `preset` (optional) and overrides any figure; see `cluster_from_toml`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from autopar.errors import ClusterSpecError, ProfileError
from autopar.validation import (MAX_DEVICES, MAX_DEVICES_PER_NODE, MAX_NODES, check_number, check_text, clip, shorten_path,
                                parse_int, path_is_file, read_text_file, shorten, type_name)
from cost_model import hardware
from cost_model.errors import CostModelInputError
from cost_model.hardware import GB, GIB, TFLOPS, CollectiveSpec, DeviceSpec, LinkSpec, SystemSpec
from cost_model.profile import HardwareProfile, load_profile

SPEC_KEYS = ("nodes", "gpus_per_node", "procs", "profile")
_KEY_ALIASES = {"devices_per_node": "gpus_per_node", "num_nodes": "nodes"}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: `num_nodes` nodes of `devices_per_node` identical devices."""

    name: str
    """The spec it was made from (or a preset name)."""
    num_nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices (GPUs, or gloo processes for `cpu`) per node."""
    device: DeviceSpec
    """The device every rank runs on."""
    intra_node: LinkSpec
    """Link between devices of one node (NVLink, shared memory)."""
    inter_node: LinkSpec
    """Link between nodes, per device (InfiniBand rail, Ethernet share)."""
    profile: HardwareProfile | None = None
    """Measured figures that refine the device and link defaults."""
    collectives: CollectiveSpec | None = None
    """The collective library's protocol terms (NCCL on the GPU presets); None: plain alpha-beta."""
    price_per_gpu_hour: float | None = None
    """What the user pays for one device for one hour (TOML `price_per_gpu_hour`; `autopar compare`)."""

    def __post_init__(self) -> None:
        where = f"cluster {shorten(self.name)}"
        _check_count(where, "nodes", self.num_nodes, MAX_NODES)
        _check_count(where, "gpus_per_node", self.devices_per_node, MAX_DEVICES_PER_NODE)
        if self.num_nodes * self.devices_per_node > MAX_DEVICES:
            raise ClusterSpecError(f"{where}: {self.num_nodes:,} nodes x {self.devices_per_node} devices = "
                                   f"{self.num_nodes * self.devices_per_node:,} devices, more than the "
                                   f"{MAX_DEVICES:,} autopar plans for")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def device_kind(self) -> str:
        return "cpu" if self.device.name.startswith("CPU") else "cuda"

    @classmethod
    def from_spec(cls, spec: "str | Path | Cluster") -> "Cluster":
        """Parse a spec string or TOML path (a Cluster is returned unchanged)."""
        return parse_cluster(spec)

    def describe(self) -> str:
        device = self.device
        bf16 = device.peak_flops("bf16") / TFLOPS
        return (f"{self.num_nodes} x {self.devices_per_node} {device.name} = {self.num_devices} devices "
                f"({device.memory_bytes / GIB:.1f} GiB, {bf16:.0f} bf16 TFLOP/s each); "
                f"intra-node {self.intra_node.name} {self.intra_node.bandwidth_bytes_per_s / GB:.0f} GB/s, "
                f"inter-node {self.inter_node.name} {self.inter_node.bandwidth_bytes_per_s / GB:.2f} GB/s per device"
                + (f"; profile of {self.profile.device_name}" if self.profile else ""))

    def fingerprint(self) -> str:
        """Stable hash of everything that changes a plan's prediction."""
        data = asdict(replace(self, name=""))
        data.pop("price_per_gpu_hour")  # a price changes no prediction
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_count(where: str, key: str, value, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterSpecError(f"{where}: {key} must be an integer, got {type_name(value)}")
    if value < 1:
        raise ClusterSpecError(f"{where}: {key} must be >= 1, got {value}")
    if value > maximum:
        raise ClusterSpecError(f"{where}: {key} must be at most {maximum:,}, got {shorten(value)}")


def parse_cluster(spec: "str | Path | Cluster") -> Cluster:
    if isinstance(spec, Cluster):
        return spec
    if not isinstance(spec, (str, Path)):
        raise ClusterSpecError(f"a cluster is a spec string such as 'dgx-a100-80g:nodes=16' or a TOML path, "
                               f"got {type_name(spec)}")
    text = str(spec).strip()
    if not text:
        raise ClusterSpecError("the cluster spec is empty; give one such as 'dgx-h100:nodes=2', 'cpu:procs=4' "
                               "or a TOML file")
    if "\x00" in text:
        raise ClusterSpecError(f"cluster spec {shorten(text)} holds a NUL byte; give a spec or a file path")
    preset, colon, rest = text.partition(":")
    # "preset:key=value,..." is a spec even when a value names a file (profile=x.toml); anything
    # else that names a .toml or an existing file is a cluster file.
    is_spec = bool(colon) and "=" in rest and "/" not in preset and not preset.endswith(".toml")
    if not is_spec and (text.endswith(".toml") or path_is_file(text)):
        return cluster_from_toml(Path(text))
    options = _parse_options(text, rest)
    if not preset.strip():
        raise ClusterSpecError(f"cluster spec {shorten(text)} names no preset before ':'; presets are "
                               f"{', '.join(hardware.PRESET_NAMES)}")
    return _build(text, preset.strip(), options, base_dir=Path.cwd())


def _parse_options(spec: str, rest: str) -> dict[str, str]:
    options: dict[str, str] = {}
    where = f"cluster spec {shorten(spec)}"
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not value.strip() or not key:
            raise ClusterSpecError(f"{where}: {shorten(item)} is not key=value (e.g. nodes=16)")
        written, key = key, _KEY_ALIASES.get(key, key)
        if key not in SPEC_KEYS:
            raise ClusterSpecError(f"{where}: unknown key {shorten(key)}{_did_you_mean(key, SPEC_KEYS)}; "
                                   f"keys are {', '.join(SPEC_KEYS)}")
        if key in options:
            raise ClusterSpecError(f"{where}: {key} is set twice"
                                   f"{f' (as {written})' if written != key else ''}; keep one")
        options[key] = value.strip()
    return options


def _did_you_mean(word: str, choices) -> str:
    if len(word) > 100:
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


_COUNT_LIMITS = {"nodes": MAX_NODES, "gpus_per_node": MAX_DEVICES_PER_NODE, "procs": MAX_DEVICES_PER_NODE}


def _positive_int(spec: str, key: str, value: Any) -> int:
    """A count from a spec string ("16") or a TOML file (16, not "16", 2.5 or true)."""
    where = f"cluster spec {shorten(spec)}"
    if isinstance(value, str):
        return parse_int(value, key, maximum=_COUNT_LIMITS[key], error=ClusterSpecError, where=where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterSpecError(f"{where}: {key} must be an integer, got {type_name(value)} {shorten(value)}")
    _check_count(where, key, value, _COUNT_LIMITS[key])
    return value


def _system(spec: str, preset: str, options: dict[str, Any]) -> SystemSpec:
    if preset == "cpu":
        if "procs" in options and "gpus_per_node" in options:
            raise ClusterSpecError(f"cluster spec {shorten(spec)}: give procs or gpus_per_node for the cpu preset, "
                                   "not both (they are the same)")
        key = "gpus_per_node" if "gpus_per_node" in options else "procs"
        procs = _positive_int(spec, key, options.get(key, 1))
        return hardware.cpu_system(procs)
    if preset not in hardware.SYSTEMS:
        raise ClusterSpecError(f"cluster spec {shorten(spec)}: unknown preset {shorten(preset)}"
                               f"{_did_you_mean(preset, hardware.PRESET_NAMES)}; presets are "
                               f"{', '.join(hardware.PRESET_NAMES)} (or give a TOML file)")
    if "procs" in options:
        raise ClusterSpecError(f"cluster spec {shorten(spec)}: 'procs' is for the cpu preset; use gpus_per_node "
                               f"for {preset}")
    return hardware.SYSTEMS[preset]


def _build(spec: str, preset: str, options: dict[str, Any], *, base_dir: Path,
           overrides: dict[str, Any] | None = None) -> Cluster:
    system = _system(spec, preset, options)
    nodes = _positive_int(spec, "nodes", options.get("nodes", 1))
    per_node = system.devices_per_node
    if "gpus_per_node" in options and preset != "cpu":
        per_node = _positive_int(spec, "gpus_per_node", options["gpus_per_node"])
        if per_node > system.devices_per_node and not overrides:
            raise ClusterSpecError(f"cluster spec {shorten(spec)}: {preset} nodes have {system.devices_per_node} "
                                   f"GPUs, gpus_per_node={per_node} is more")
    device, intra, inter = system.device, system.intra_node, system.inter_node
    if overrides:
        device, intra, inter = _apply_overrides(spec, device, intra, inter, overrides)
    profile = None
    if "profile" in options:
        name = options["profile"]
        if not isinstance(name, str) or not name.strip():
            raise ClusterSpecError(f"cluster spec {shorten(spec)}: profile must be a string (the path of a JSON "
                                   f"file from `autopar profile`), got {type_name(name)} {shorten(name)}")
        profile = _load_checked_profile(spec, base_dir / name, preset, device)
    return Cluster(name=spec, num_nodes=nodes, devices_per_node=per_node, device=device,
                   intra_node=intra, inter_node=inter, profile=profile, collectives=system.collectives)


def _load_checked_profile(spec: str, path: Path, preset: str, device: DeviceSpec) -> HardwareProfile:
    if path.suffix == ".toml":
        raise ProfileError(f"cluster spec {shorten(spec)}: profile={shorten(path.name)} names a TOML file; profile= "
                           "takes the JSON file `autopar profile --out FILE` writes. A cluster TOML is given on "
                           "its own: --cluster cluster.toml")
    try:
        profile = load_profile(path)
    except CostModelInputError as error:
        raise ProfileError(f"cluster spec {shorten(spec)}: {error}") from None
    expected_kind = "cpu" if preset == "cpu" else "cuda"
    if profile.device_kind != expected_kind:
        raise ProfileError(f"cluster spec {shorten(spec)}: profile {shorten_path(path)} was measured on "
                           f"{profile.device_kind} ({shorten(profile.device_name)}) but the cluster's devices are {expected_kind}; "
                           "profile the machine you plan for")
    if expected_kind == "cuda":
        model = device.name.split()[0]
        if model.lower() not in profile.device_name.lower():
            raise ProfileError(f"cluster spec {shorten(spec)}: profile {shorten_path(path)} was measured on "
                               f"{shorten(profile.device_name)}, "
                               f"not on {device.name}; use a profile of that device or the matching preset")
    return profile


# --- TOML ----------------------------------------------------------------------------------

_DEVICE_FIELDS = {
    "name": ("name", str, 1.0),
    "memory_gib": ("memory_bytes", float, GIB),
    "memory_bandwidth_gbs": ("memory_bandwidth_bytes_per_s", float, GB),
    "matmul_efficiency": ("matmul_efficiency", float, 1.0),
    "fp8_matmul_efficiency": ("fp8_matmul_efficiency", float, 1.0),
    "memory_efficiency": ("memory_efficiency", float, 1.0),
    "kernel_overhead_us": ("kernel_overhead_s", float, 1e-6),
    "host_link_gbs": ("host_link_bytes_per_s", float, GB),
    "host_memory_bandwidth_gbs": ("host_memory_bandwidth_bytes_per_s", float, GB),
    "host_memory_gib": ("host_memory_bytes", float, GIB),
    "power_limit_w": ("power_limit_w", float, 1.0),
    "board_power_w": ("board_power_w", float, 1.0),
    "clock_power_exponent": ("clock_power_exponent", float, 1.0),
    "attention_kernel": ("attention_kernel", str, 1.0),
}
_DEVICE_TFLOPS = {f"{dtype}_tflops": dtype for dtype in hardware.DTYPES}
_LINK_FIELDS = {
    "name": ("name", str, 1.0),
    "bandwidth_gbs": ("bandwidth_bytes_per_s", float, GB),
    "latency_us": ("latency_s", float, 1e-6),
    "efficiency": ("efficiency", float, 1.0),
}
_TOML_TOP_KEYS = ("preset", "nodes", "gpus_per_node", "procs", "profile", "price_per_gpu_hour", "device", "intra_node",
                  "inter_node")


def cluster_from_toml(path: Path) -> Cluster:
    """A cluster file: `preset = "dgx-h100"`, `nodes = 2`, optional `price_per_gpu_hour = 2.5`, and
    optional [device], [intra_node], [inter_node] tables overriding figures (memory_gib,
    bf16_tflops, bandwidth_gbs, latency_us...)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    text = read_text_file(path, "cluster file", error=ClusterSpecError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ClusterSpecError(f"cluster file {shorten_path(path)} is not valid TOML: {shorten(str(error), 200)}") \
            from None
    except RecursionError:
        raise ClusterSpecError(f"cluster file {shorten_path(path)} is nested too deeply to be a cluster file") \
            from None
    spec = str(path)
    for key in data:
        if key not in _TOML_TOP_KEYS:
            raise ClusterSpecError(f"cluster file {shorten(spec)}: unknown key {shorten(key)}"
                                   f"{_did_you_mean(key, _TOML_TOP_KEYS)}; "
                                   f"keys are {', '.join(_TOML_TOP_KEYS)}")
    preset = data.get("preset", "cpu" if "procs" in data else None)
    if not isinstance(preset, str):
        raise ClusterSpecError(f"cluster file {shorten(spec)}: set preset = \"{hardware.PRESET_NAMES[0]}\" "
                               f"(one of {', '.join(hardware.PRESET_NAMES)}) and override figures in [device]")
    options = {key: data[key] for key in SPEC_KEYS if key in data}
    for key in ("nodes", "gpus_per_node", "procs"):
        if key in options and (isinstance(options[key], bool) or not isinstance(options[key], int)):
            raise ClusterSpecError(f"cluster file {shorten(spec)}: {key} must be an integer, got "
                                   f"{type_name(options[key])} {shorten(options[key])}")
    overrides = {key: data[key] for key in ("device", "intra_node", "inter_node") if key in data}
    cluster = _build(spec, preset, options, base_dir=path.parent, overrides=overrides)
    if "price_per_gpu_hour" in data:
        cluster = replace(cluster, price_per_gpu_hour=_number(spec, "price_per_gpu_hour", data["price_per_gpu_hour"]))
    return cluster


def _apply_overrides(spec: str, device: DeviceSpec, intra: LinkSpec, inter: LinkSpec,
                     overrides: dict[str, Any]) -> tuple[DeviceSpec, LinkSpec, LinkSpec]:
    for table in overrides.values():
        if not isinstance(table, dict):
            raise ClusterSpecError(f"cluster file {shorten(spec)}: [device], [intra_node] and [inter_node] must be "
                                   "tables")
    device_table = dict(overrides.get("device", {}))
    peak = dict(device.peak_flops_per_s)
    for key in [key for key in device_table if key in _DEVICE_TFLOPS]:
        peak[_DEVICE_TFLOPS[key]] = _number(spec, f"device.{key}", device_table.pop(key)) * TFLOPS
    device = _replace_fields(spec, "device", device, device_table, _DEVICE_FIELDS)
    device = _checked(spec, "device", lambda: replace(device, peak_flops_per_s=peak))
    intra = _replace_fields(spec, "intra_node", intra, dict(overrides.get("intra_node", {})), _LINK_FIELDS)
    inter = _replace_fields(spec, "inter_node", inter, dict(overrides.get("inter_node", {})), _LINK_FIELDS)
    return device, intra, inter


def _replace_fields(spec: str, table: str, base, values: dict[str, Any], fields: dict):
    changes = {}
    known = list(fields) + (list(_DEVICE_TFLOPS) if table == "device" else [])
    for key, value in values.items():
        if key not in fields:
            raise ClusterSpecError(f"cluster file {shorten(spec)}: unknown key '{table}.{clip(key, 40)}'"
                                   f"{_did_you_mean(key, known)}; "
                                   f"keys are {', '.join(known)}")
        attribute, kind, scale = fields[key]
        if kind is str:
            changes[attribute] = check_text(value, f"{table}.{key}", maximum=200, error=ClusterSpecError,
                                            where=f"cluster file {shorten(spec)}")
        else:
            changes[attribute] = _number(spec, f"{table}.{key}", value) * scale
    return _checked(spec, table, lambda: replace(base, **changes))


_MAX_FIGURE = 1e9
"""Largest figure in a cluster file's own unit (GiB, TFLOP/s, GB/s, us): beyond any hardware."""


def _number(spec: str, field_name: str, value: Any) -> float:
    return check_number(value, field_name, positive=True, maximum=_MAX_FIGURE, error=ClusterSpecError,
                        where=f"cluster file {shorten(spec)}")


def _checked(spec: str, table: str, make):
    try:
        return make()
    except ValueError as error:
        raise ClusterSpecError(f"cluster file {shorten(spec)}: [{table}] {clip(str(error), 300)}") from None

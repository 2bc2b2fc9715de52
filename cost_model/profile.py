"""The hardware profile: what `autopar profile` measured on a machine, as versioned JSON.

A profile holds raw measurements (matmul throughput by size and dtype, streaming bandwidth,
kernel overhead, collective times by group size and message size). The cost model interpolates
the matmul table and fits an alpha-beta line per collective and link level (see comm.py).
Version 2 adds `calibrations`: whole-step terms fitted to measured steps (calibration.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cost_model.calibration import Calibration, calibration_from_dict, is_stale
from cost_model.errors import CostModelInputError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 2 added `calibrations`; version 1 files (without them) are still read."""
MAX_TEXT_CHARS = 1_000
"""Longest device name, host or dtype a profile may hold."""
MAX_COUNT = 1 << 20
"""Largest process or group count a profile may hold."""
SHOWN_CHARS = 80
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
LINK_LEVELS = ("intra_node", "inter_node")
ELEMENTWISE_KINDS = ("transcendental", "normalize", "upcast", "broadcast")


@dataclass(frozen=True, kw_only=True)
class MatmulPoint:
    """One measured matmul size."""

    dtype: str
    """dtype key: "fp32", "bf16", ..."""
    flops: float
    """FLOPs of the measured matmul (2 m n k)."""
    achieved_flops_per_s: float
    """Measured throughput."""


@dataclass(frozen=True, kw_only=True)
class ElementwisePoint:
    """Arithmetic throughput of element-wise kernels of one kind (a ceiling besides bandwidth)."""

    kind: str
    """One of ELEMENTWISE_KINDS."""
    elements_per_s: float
    """Output elements per second, measured on a tensor that streams from memory."""


@dataclass(frozen=True, kw_only=True)
class AttentionPoint:
    """Fused attention (sdpa, bf16) at one size: torch's FLOP count over the measured time."""

    phase: str
    """"forward" or "backward" (measured as forward + backward less forward)."""
    causal: bool
    """is_causal: the kernel skips the masked half, so its rate on the full count runs above a
    matmul's."""
    flops: float
    """FLOPs as torch counts them (the full s x s square; autopar/capture/attention_flops.py)."""
    achieved_flops_per_s: float


ATTENTION_PHASES = ("forward", "backward")


@dataclass(frozen=True, kw_only=True)
class GroupedMatmulPoint:
    """A grouped matmul (torch._grouped_mm: `experts` matmuls of equal rows) at one size."""

    dtype: str
    experts: int
    flops_per_expert: float
    """FLOPs of one expert's matmul (2 m k n): what its rate is looked up by."""
    achieved_flops_per_s: float
    """All experts' FLOPs over the measured time."""


@dataclass(frozen=True, kw_only=True)
class CollectivePoint:
    """One measured collective."""

    op: str
    """One of COLLECTIVE_OPS."""
    level: str
    """"intra_node" or "inter_node": the slowest link the group crosses."""
    num_devices: int
    """Group size."""
    message_bytes: float
    """Size of the per-device input buffer (the full tensor for all-reduce)."""
    time_s: float
    """Median measured time."""


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Measurements of one kind of device and its links."""

    schema_version: int
    """Format version; files of another version are refused."""
    device_kind: str
    """"cpu" or "cuda"."""
    device_name: str
    """e.g. "NVIDIA H200" or "CPU (2 cores)"."""
    num_processes: int
    """Processes (devices) the collectives were measured on."""
    memory_bytes: float
    """Memory capacity per device (per process on a CPU)."""
    memory_bandwidth_bytes_per_s: float
    """Achieved bandwidth of large element-wise kernels (read + write counted)."""
    kernel_overhead_s: float
    """Time of a tiny kernel (launch/dispatch overhead)."""
    matmul: tuple[MatmulPoint, ...]
    """Matmul throughput sweep."""
    collectives: tuple[CollectivePoint, ...] = ()
    """Collective sweep (empty when measured with one process)."""
    elementwise: tuple[ElementwisePoint, ...] = ()
    """Element rates of arithmetic-heavy kernels (GELU, softmax...); absent in older profiles."""
    attention: tuple[AttentionPoint, ...] = ()
    """Fused attention throughput by phase, mask and size (GPUs; absent in older profiles and on
    CPUs: attention is then priced as a matmul of its FLOPs)."""
    grouped_matmul: tuple[GroupedMatmulPoint, ...] = ()
    """Grouped (MoE expert) matmul throughput by rows per expert (absent in older profiles, and for
    dtypes the device's _grouped_mm does not run: the matmul sweep then prices them)."""
    created: str = ""
    """ISO timestamp."""
    host: str = ""
    """Host name where it was measured."""
    calibrations: tuple[Calibration, ...] = ()
    """Whole-step calibrations (`autopar profile --calibrate`), one per process count."""
    stale_calibrations: int = 0
    """Calibrations dropped when the file was read: made by an earlier autopar whose terms had
    other units (an older CALIBRATION_VERSION); not written back."""

    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({point.dtype for point in self.matmul}))

    def to_json(self) -> str:
        data = asdict(self)
        del data["stale_calibrations"]
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def load_profile(path: str | Path) -> HardwareProfile:
    """Read and validate a profile; raises CostModelInputError naming the file and field."""
    path = Path(path)
    shown = _shorten_path(str(path))
    redo = "re-create it with `autopar profile --out FILE`"
    try:
        if path.is_dir():
            raise CostModelInputError(f"profile {shown} is a folder, not a file; give the JSON file of a profile")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CostModelInputError(f"profile {shown} is not UTF-8 text (a binary file?); a profile is the JSON "
                                  f"file `autopar profile` writes: {redo}") from None
    except OSError as error:
        reason = "the file name is too long" if error.errno == 36 else error.strerror or str(error)
        raise CostModelInputError(f"cannot read profile {shown}: {reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CostModelInputError(
            f"profile {shown} is not valid JSON ({error.msg} at line {error.lineno}); {redo}") from None
    except RecursionError:
        raise CostModelInputError(f"profile {shown} is nested too deeply to be a profile; {redo}") from None
    return profile_from_dict(data, source=str(path))


def _shorten(text: str) -> str:
    """'text' quoted, cut to SHOWN_CHARS with its length said (no 10 MB value in a message)."""
    return repr(text) if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]!r}... ({len(text):,} characters)"


def _shorten_path(text: str) -> str:
    """A path quoted, its start cut when long: the file's name is what the reader needs."""
    return repr(text) if len(text) <= SHOWN_CHARS else f"...{text[-SHOWN_CHARS:]!r} ({len(text):,} characters)"


def _shown(value: Any) -> str:
    """repr(value), cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def profile_from_dict(data: Any, *, source: str = "<profile>") -> HardwareProfile:
    source = source if len(source) <= SHOWN_CHARS else f"...{source[-SHOWN_CHARS:]}"  # the file name is the end
    if not isinstance(data, dict):
        raise CostModelInputError(f"profile '{source}': expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise CostModelInputError(
            f"profile '{source}': schema_version is {_shown(version)}, this autopar reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; re-create it with `autopar profile --out FILE`")
    reader = _FieldReader(data, source)
    matmul = tuple(_matmul_point(item, source, index) for index, item in enumerate(reader.list("matmul")))
    if not matmul:
        raise CostModelInputError(f"profile '{source}': field 'matmul' is empty; re-run `autopar profile`")
    collectives = tuple(
        _collective_point(item, source, index) for index, item in enumerate(reader.list("collectives", required=False)))
    elementwise = tuple(_elementwise_point(item, source, index)
                        for index, item in enumerate(reader.list("elementwise", required=False)))
    attention = tuple(_attention_point(item, source, index)
                      for index, item in enumerate(reader.list("attention", required=False)))
    grouped = tuple(_grouped_point(item, source, index)
                    for index, item in enumerate(reader.list("grouped_matmul", required=False)))
    stored = reader.list("calibrations", required=False)
    current = [item for item in stored if not is_stale(item)]
    device_kind = reader.text("device_kind")
    if device_kind not in ("cpu", "cuda"):
        raise CostModelInputError(f"profile '{source}': field 'device_kind' must be 'cpu' or 'cuda', "
                                  f"got {_shorten(device_kind)}")
    return HardwareProfile(
        schema_version=SCHEMA_VERSION,
        device_kind=device_kind,
        device_name=reader.text("device_name"),
        num_processes=reader.count("num_processes"),
        memory_bytes=reader.positive("memory_bytes"),
        memory_bandwidth_bytes_per_s=reader.positive("memory_bandwidth_bytes_per_s"),
        kernel_overhead_s=reader.non_negative("kernel_overhead_s"),
        matmul=matmul,
        collectives=collectives,
        elementwise=elementwise,
        attention=attention,
        grouped_matmul=grouped,
        created=str(data.get("created", ""))[:MAX_TEXT_CHARS],
        host=str(data.get("host", ""))[:MAX_TEXT_CHARS],
        calibrations=tuple(calibration_from_dict(item, source=source) for item in current),
        stale_calibrations=len(stored) - len(current),
    )


class _FieldReader:
    def __init__(self, data: dict, source: str) -> None:
        self.data = data
        self.source = source

    def _get(self, name: str) -> Any:
        if name not in self.data:
            raise CostModelInputError(f"profile '{self.source}': missing field '{name}'")
        return self.data[name]

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str):
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be a string, "
                                      f"got {type(value).__name__}")
        if len(value) > MAX_TEXT_CHARS:
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be at most {MAX_TEXT_CHARS:,} "
                                      f"characters, got {_shorten(value)}")
        return value

    def number(self, name: str) -> float:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be a finite number, "
                                      f"got {_shown(value)}")
        return float(value)

    def count(self, name: str) -> int:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be an integer, "
                                      f"got {_shown(value)}")
        if not 1 <= value <= MAX_COUNT:
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be >= 1 and at most "
                                      f"{MAX_COUNT:,}, got {_shown(value)}")
        return value

    def positive(self, name: str) -> float:
        value = self.number(name)
        if value <= 0:
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be positive, got {value}")
        return value

    def non_negative(self, name: str) -> float:
        value = self.number(name)
        if value < 0:
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be >= 0, got {value}")
        return value

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        value = self.text(name)
        if value not in choices:
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be one of "
                                      f"{', '.join(choices)}, got {_shorten(value)}")
        return value

    def flag(self, name: str) -> bool:
        value = self._get(name)
        if not isinstance(value, bool):
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be true or false, "
                                      f"got {_shown(value)}")
        return value

    def list(self, name: str, *, required: bool = True) -> list:
        if not required and name not in self.data:
            return []
        value = self._get(name)
        if not isinstance(value, list):
            raise CostModelInputError(f"profile '{self.source}': field '{name}' must be a list, "
                                      f"got {type(value).__name__}")
        return value


def _item_reader(item: Any, source: str, field: str, index: int) -> _FieldReader:
    if not isinstance(item, dict):
        raise CostModelInputError(f"profile '{source}': {field}[{index}] must be an object with named fields, "
                                  f"got {type(item).__name__}")
    return _FieldReader(item, f"{source}: {field}[{index}]")


def _matmul_point(item: Any, source: str, index: int) -> MatmulPoint:
    reader = _item_reader(item, source, "matmul", index)
    return MatmulPoint(dtype=reader.text("dtype"), flops=reader.positive("flops"),
                       achieved_flops_per_s=reader.positive("achieved_flops_per_s"))


def _collective_point(item: Any, source: str, index: int) -> CollectivePoint:
    reader = _item_reader(item, source, "collectives", index)
    return CollectivePoint(op=reader.choice("op", COLLECTIVE_OPS), level=reader.choice("level", LINK_LEVELS),
                           num_devices=reader.count("num_devices"), message_bytes=reader.positive("message_bytes"),
                           time_s=reader.positive("time_s"))


def _elementwise_point(item: Any, source: str, index: int) -> ElementwisePoint:
    reader = _item_reader(item, source, "elementwise", index)
    return ElementwisePoint(kind=reader.choice("kind", ELEMENTWISE_KINDS),
                            elements_per_s=reader.positive("elements_per_s"))


def _attention_point(item: Any, source: str, index: int) -> AttentionPoint:
    reader = _item_reader(item, source, "attention", index)
    return AttentionPoint(phase=reader.choice("phase", ATTENTION_PHASES), causal=reader.flag("causal"),
                          flops=reader.positive("flops"), achieved_flops_per_s=reader.positive("achieved_flops_per_s"))


def _grouped_point(item: Any, source: str, index: int) -> GroupedMatmulPoint:
    reader = _item_reader(item, source, "grouped_matmul", index)
    return GroupedMatmulPoint(dtype=reader.text("dtype"), experts=reader.count("experts"),
                              flops_per_expert=reader.positive("flops_per_expert"),
                              achieved_flops_per_s=reader.positive("achieved_flops_per_s"))

"""Checks of user input shared by the API, the CLI, cluster specs and plan files.

Every check raises an AutoparError subclass (the caller picks which) whose message names the
argument or field, what it got (truncated: a 10 MB value is not echoed back) and what to give
instead. Sizes are bounded here, before anything is built or enumerated, so an absurd number
fails in microseconds instead of hanging a divisor loop or a layer-by-layer build.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError, ConfigError

MAX_NODES = 65_536
"""Nodes in one cluster (the largest published training jobs use a few thousand)."""
MAX_DEVICES_PER_NODE = 1_024
"""Devices (or gloo processes) per node."""
MAX_DEVICES = 1_048_576
"""Devices in one cluster: bounds the planner's enumeration of mesh shapes."""
MAX_GLOBAL_BATCH = 1_048_576
"""Samples per optimizer step: bounds the enumeration of microbatch sizes."""
MAX_TEXT_CHARS = 10_000
"""Longest name, note or placement a plan or cluster file may hold."""
MAX_FILE_BYTES = 1 << 30
"""Largest plan, profile or cluster file read (a plan for a 1,000-layer model is a few MB)."""
SHOWN_CHARS = 80
"""Characters of a value shown in an error message."""

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """repr(value), cut to `limit` characters with the full length said."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value) if isinstance(value, str) else text
    return f"{text[:limit]!r}... ({len(text):,} characters)" if isinstance(value, str) else \
        f"{text[:limit]}... ({len(text):,} characters)"


def shorten_path(path: Any, limit: int = SHOWN_CHARS) -> str:
    """A path quoted, its start cut when long (the file's name, at the end, is what the reader needs)."""
    text = str(path)
    return repr(text) if len(text) <= limit else f"...{text[-limit:]!r} ({len(text):,} characters)"


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` itself (no quotes), cut to `limit` characters with the full length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def type_name(value: Any) -> str:
    """"a str", "an int", "None", "a class": how a value is named in messages."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


# --- numbers ------------------------------------------------------------------------------------

def check_int(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None,
              error: type[AutoparError] = ConfigError, where: str = "") -> int:
    """An int (not a bool, float or str) in [minimum, maximum]."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{prefix}{name} must be an integer, got {type_name(value)} {shorten(value)}")
    return check_range(value, name, minimum=minimum, maximum=maximum, error=error, where=where)


def check_range(value: int | float, name: str, *, minimum: float | None = None, maximum: float | None = None,
                error: type[AutoparError] = ConfigError, where: str = "") -> Any:
    prefix = f"{where}: " if where else ""
    if minimum is not None and value < minimum:
        raise error(f"{prefix}{name} must be >= {minimum}, got {shorten(value)}")
    if maximum is not None and value > maximum:
        raise error(f"{prefix}{name} must be at most {maximum:,}, got {shorten(value)}")
    return value


def parse_int(text: str, name: str, *, minimum: int = 1, maximum: int | None = None,
              error: type[AutoparError] = ConfigError, where: str = "") -> int:
    """An integer written in ASCII digits ("12", not "1.5", "1e3" or "١٢"), then range-checked."""
    prefix = f"{where}: " if where else ""
    if not _INTEGER.fullmatch(text.strip()):
        raise error(f"{prefix}{name} must be an integer, got {shorten(text)}")
    digits = text.strip().lstrip("+-")
    if maximum is not None and len(digits.lstrip("0")) > len(str(maximum)):  # no int() of 10,000 digits
        raise error(f"{prefix}{name} must be at most {maximum:,}, got {shorten(text.strip())}")
    return check_range(int(text), name, minimum=minimum, maximum=maximum, error=error, where=where)


def check_number(value: Any, name: str, *, minimum: float | None = None, maximum: float | None = None,
                 positive: bool = False, error: type[AutoparError] = ConfigError, where: str = "") -> float:
    """A finite int or float (not a bool or str), optionally > 0 and within bounds."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{prefix}{name} must be a number, got {type_name(value)} {shorten(value)}")
    if not math.isfinite(value):
        raise error(f"{prefix}{name} must be a finite number, got {value}")
    if positive and value <= 0:
        raise error(f"{prefix}{name} must be positive, got {value}")
    return float(check_range(value, name, minimum=minimum, maximum=maximum, error=error, where=where))


def check_choice(value: Any, name: str, choices: Iterable[Any], *, error: type[AutoparError] = ConfigError,
                 where: str = "") -> Any:
    prefix = f"{where}: " if where else ""
    allowed = tuple(choices)
    if isinstance(value, bool) or not any(type(value) is type(choice) and value == choice for choice in allowed):
        raise error(f"{prefix}{name} must be one of {', '.join(repr(choice) for choice in allowed)}, "
                    f"got {shorten(value)}")
    return value


def check_text(value: Any, name: str, *, allow_empty: bool = False, maximum: int = MAX_TEXT_CHARS,
               error: type[AutoparError] = ConfigError, where: str = "") -> str:
    prefix = f"{where}: " if where else ""
    if not isinstance(value, str):
        raise error(f"{prefix}{name} must be a string, got {type_name(value)} {shorten(value)}")
    if not allow_empty and not value.strip():
        raise error(f"{prefix}{name} is empty; give a name")
    if len(value) > maximum:
        raise error(f"{prefix}{name} must be at most {maximum:,} characters, got {shorten(value)}")
    return value


# --- files --------------------------------------------------------------------------------------

def read_text_file(path: str | Path, what: str, *, error: type[AutoparError]) -> str:
    """The UTF-8 text of a file, or `error` saying why it cannot be read (missing, a folder, a
    name too long, binary, huge)."""
    shown = shorten_path(path)
    try:
        size = os.stat(path).st_size
        if Path(path).is_dir():
            raise error(f"{what} {shown} is a folder, not a file; give the file's path")
        if size > MAX_FILE_BYTES:
            raise error(f"{what} {shown} is {size / 2**20:,.0f} MiB, more than a {what} can be "
                        f"({MAX_FILE_BYTES >> 20:,} MiB); give the right file")
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as decode:
        raise error(f"{what} {shown} is not UTF-8 text (byte {decode.start} is {decode.object[decode.start]:#04x}): "
                    f"it looks binary; give the text file autopar wrote") from None
    except OSError as os_error:
        raise error(f"cannot read {what} {shown}: {_os_reason(os_error)}") from None
    except ValueError as value_error:  # an embedded NUL byte in the name
        raise error(f"cannot read {what} {shown}: {value_error}") from None


def _os_reason(error: OSError) -> str:
    if error.errno == 36 or isinstance(error, OSError) and "name too long" in str(error).lower():
        return "the file name is too long for the operating system"
    if isinstance(error, IsADirectoryError):
        return "it is a folder, not a file"
    return error.strerror or str(error)


def parse_json(text: str, source: str, what: str, *, error: type[AutoparError]) -> Any:
    """json.loads with a message for malformed or absurdly nested text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as decode:
        raise error(f"{what} {shorten(source)} is not valid JSON ({decode.msg} at line {decode.lineno})") from None
    except RecursionError:
        raise error(f"{what} {shorten(source)} is nested too deeply to be a {what}; give the file autopar "
                    "wrote") from None


def path_is_file(text: str) -> bool:
    """Path(text).is_file() that answers False for names the OS refuses (too long, NUL bytes)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def check_output_path(path: Any, flag: str = "--out") -> Path:
    """A file that can be written: not empty, not a folder, in a folder that exists; checked
    before the work whose result it will hold."""
    if not isinstance(path, (str, Path)):
        raise ConfigError(f"{flag} must be a file path, got {type_name(path)}")
    text = str(path)
    if not text.strip():
        raise ConfigError(f"{flag} is empty; give a file name such as {flag} result.json")
    if "\x00" in text:
        raise ConfigError(f"{flag} {shorten(text)} holds a NUL byte; give a file name")
    target = Path(text).expanduser()
    too_long = len(target.name.encode()) > 255 or len(text.encode()) > 4096
    if too_long:
        raise ConfigError(f"{flag} {shorten(text)} is too long for a file name; give a shorter one")
    if target.is_dir():
        raise ConfigError(f"{flag} {shorten(text)} is a folder; give a file name inside it, e.g. "
                          f"{flag} {target / 'result.json'}")
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {shorten(text)}: the folder {shorten(str(folder))} does not exist; "
                          "create it first or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {shorten(text)}: the folder {shorten(str(folder))} is not writable")
    return target


# --- planning arguments -------------------------------------------------------------------------

PRECISION_NAMES = ("bf16", "fp32")
_DEGREES = ("dp", "tp", "pp")
_POSITIVE_CONSTRAINTS = ("dp", "tp", "pp", "cp", "microbatch_size", "virtual_stages", "layers_per_virtual_stage",
                         "ep")


def check_global_batch(value: Any, name: str = "global_batch") -> int:
    return check_int(value, name, maximum=MAX_GLOBAL_BATCH)


def check_constraint_values(value: Any) -> dict[str, Any]:
    """The constraints as a dict of checked values (None: left to the search)."""
    from autopar.solver.step_model import RECOMPUTE_MODES, SCHEDULES

    if value is None:
        return {}
    if hasattr(value, "__dataclass_fields__") and type(value).__name__ == "Constraints":
        value = {name: getattr(value, name) for name in value.__dataclass_fields__}
    if not isinstance(value, dict):
        raise ConfigError(f"constraints must be a dict such as {{'tp': 8, 'pp': 2}} (or a Constraints), "
                          f"got {type_name(value)} {shorten(value)}")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"constraint names are strings such as 'tp', got {shorten(key)}")
        if item is None:
            checked[key] = None
        elif key in _POSITIVE_CONSTRAINTS:
            checked[key] = check_int(item, f"constraints['{key}']", maximum=MAX_DEVICES)
        elif key == "zero_stage":
            checked[key] = check_choice(item, "constraints['zero_stage']", (0, 1, 2, 3))
        elif key == "schedule":
            checked[key] = check_choice(item, "constraints['schedule']", SCHEDULES)
        elif key == "recompute":
            checked[key] = check_choice(item, "constraints['recompute']", RECOMPUTE_MODES)
        elif key in ("offload", "sequence_parallel"):
            checked[key] = _check_flag(item, f"constraints['{key}']")
        else:
            checked[key] = item  # an unknown name: Constraints.from_value names the known ones
    if checked.get("sequence_parallel") is False and checked.get("recompute") == "gathers":
        _refuse_gathers_without_sp("constraints['recompute']")
    _refuse_zero3_with_zero_bubble(checked.get("schedule"), checked.get("zero_stage"), "constraints")
    return checked


def _zero3_with_zero_bubble(schedule: Any, zero_stage: Any) -> str:
    """Why this schedule cannot run with this ZeRO stage ("" when it can)."""
    from autopar.solver.search import ZERO3_WITH_ZERO_BUBBLE
    from autopar.solver.step_model import ZERO_BUBBLE_SCHEDULES

    if schedule in ZERO_BUBBLE_SCHEDULES and zero_stage == 3:
        return f"schedule '{schedule}' with zero_stage 3: {ZERO3_WITH_ZERO_BUBBLE}"
    return ""


def _refuse_zero3_with_zero_bubble(schedule: Any, zero_stage: Any, where: str) -> None:
    reason = _zero3_with_zero_bubble(schedule, zero_stage)
    if reason:
        raise ConfigError(f"{where}: {reason}")


def _refuse_gathers_without_sp(name: str) -> None:
    from autopar.solver.search import GATHERS_WITHOUT_SP

    raise ConfigError(f"{name}='gathers' with sequence_parallel=False: {GATHERS_WITHOUT_SP}")


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {type_name(value)} {shorten(value)}")
    return value


def check_fixed_config(*, tp: Any, pp: Any, dp: Any, microbatch_size: Any, schedule: Any, virtual_stages: Any,
                       layers_per_virtual_stage: Any, recompute: Any, zero_stage: Any, ep: Any = 1,
                       cp: Any = 1, offload: Any = False, sequence_parallel: Any = True) -> None:
    """The arguments of `evaluate`: types and ranges, before anything is captured."""
    from autopar.solver.step_model import RECOMPUTE_MODES, SCHEDULES

    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("microbatch_size", microbatch_size)):
        check_int(value, name, maximum=MAX_DEVICES if name != "microbatch_size" else MAX_GLOBAL_BATCH)
    for name, value in (("dp", dp), ("virtual_stages", virtual_stages),
                        ("layers_per_virtual_stage", layers_per_virtual_stage)):
        if value is not None:
            check_int(value, name, maximum=MAX_DEVICES)
    check_choice(schedule, "schedule", SCHEDULES)
    check_choice(recompute, "recompute", RECOMPUTE_MODES)
    check_choice(zero_stage, "zero_stage", (0, 1, 2, 3))
    _check_flag(offload, "offload")
    if not _check_flag(sequence_parallel, "sequence_parallel") and recompute == "gathers":
        _refuse_gathers_without_sp("recompute")
    _refuse_zero3_with_zero_bubble(schedule, zero_stage, "evaluate")


def check_degrees(cluster, global_batch: int, *, dp: int | None = None, tp: int | None = None,
                  pp: int | None = None, microbatch_size: int | None = None, schedule: str | None = None,
                  cp: int | None = None) -> None:
    """Fixed parallel degrees that cannot work on this cluster and batch, said in those terms
    (before any capture: none of this needs the model). An unfixed cp counts as 1 here."""
    devices, per_node = cluster.num_devices, cluster.devices_per_node
    fixed = {name: value for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)) if value}
    for name, value in fixed.items():
        if value > devices:
            raise ConfigError(f"{name}={value} is more than the cluster's {devices} devices; use {name} <= {devices}")
    if tp and tp > per_node:
        raise ConfigError(f"tp={tp} is more than the {per_node} GPUs of one node: tensor parallelism runs inside a "
                          f"node; use tp <= {per_node} and spread the rest over pp or dp")
    for name, value in fixed.items():
        if devices % value:
            raise ConfigError(f"{name}={value} does not divide the cluster's {devices} devices")
    if len(fixed) > 1:
        product = math.prod(fixed.values())
        shown = f"{' x '.join(fixed)} = {' x '.join(map(str, fixed.values()))} = {product}"
        if product > devices or devices % product:
            raise ConfigError(f"{shown} {'is more than' if product > devices else 'does not divide'} the cluster's "
                              f"{devices} devices; dp x tp x pp{' x cp' if cp else ''} must equal {devices}")
        if len(set(fixed) & {"dp", "tp", "pp"}) == 3 and product != devices:
            raise ConfigError(f"{shown}, but the cluster has {devices} devices; dp x tp x pp{' x cp' if cp else ''} "
                              f"must equal {devices}")
    if dp and global_batch % dp:
        raise ConfigError(f"global batch {global_batch} is not divisible by dp={dp}; every data-parallel replica "
                          "takes the same number of samples")
    if microbatch_size:
        local = global_batch // dp if dp else global_batch
        if microbatch_size > local or local % microbatch_size:
            where = f"the per-replica batch {local} (global batch {global_batch} / dp {dp})" if dp else \
                f"the global batch {global_batch}"
            raise ConfigError(f"{where} is not divisible by microbatch size {microbatch_size}")
    if schedule == "interleaved" and pp == 1:
        raise ConfigError("the interleaved schedule needs pp >= 2 (it interleaves model chunks across stages); "
                          "use pp >= 2 or another schedule")
    if schedule in ("zb1p", "zbv") and pp == 1:
        raise ConfigError(f"the {schedule} schedule needs pp >= 2 (it is a pipeline schedule); use pp >= 2 or "
                          "another schedule")


def check_pipeline_depth(graph, pp: int | None) -> None:
    """A pipeline needs at least one segment (prologue, block or epilogue) per stage."""
    segments = len(graph.segments)
    if pp and pp > segments:
        blocks = sum(1 for segment in graph.segments if segment.block_group is not None)
        name = shorten(graph.model_name, 60) if graph.model_name else "the model"
        raise ConfigError(f"pp={pp} needs at least {pp} pipeline segments, but {name} has "
                          f"{segments} ({blocks} repeated blocks and {segments - blocks} other segments); "
                          f"use pp <= {segments}")


# --- plan files ---------------------------------------------------------------------------------

MESH_AXES = ("pp", "dp", "tp")
OPTIONAL_MESH_AXES = ("cp",)
"""Axes a plan's mesh may leave out (size 1): context parallelism came with schema version 2."""


class _PlanFields:
    """Typed reads of a plan's JSON, each error naming the field by its path (stages[0].layers)."""

    def __init__(self, source: str) -> None:
        from autopar.errors import PlanMismatchError

        self.error = PlanMismatchError
        self.where = f"plan {shorten(source)}"

    def fail(self, message: str):
        raise self.error(f"{self.where} is missing or has a malformed field: {message}; fix the file or re-run "
                         "`autopar plan`")

    def get(self, data: dict, key: str, path: str, default: Any = ...) -> Any:
        if key not in data:
            if default is not ...:
                return default
            self.fail(f"field '{path}' is missing")
        return data[key]

    def object(self, value: Any, path: str) -> dict:
        if not isinstance(value, dict):
            self.fail(f"{path} must be an object, got {type_name(value)} {shorten(value)}")
        return value

    def list(self, value: Any, path: str) -> list:
        if not isinstance(value, (list, tuple)):
            self.fail(f"{path} must be a list, got {type_name(value)} {shorten(value)}")
        return list(value)

    def integer(self, value: Any, path: str, *, minimum: int = 1, maximum: int = MAX_DEVICES) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{path} must be an integer, got {type_name(value)} {shorten(value)}")
        if not minimum <= value <= maximum:
            self.fail(f"{path} must be >= {minimum} and at most {maximum:,}, got {shorten(value)}")
        return value

    def number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{path} must be a number, got {type_name(value)} {shorten(value)}")
        if not math.isfinite(value):
            self.fail(f"{path} must be a finite number, got {value}")
        if value < 0:
            self.fail(f"{path} must be >= 0, got {value}")
        return value

    def finite(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"{path} must be a finite number, got {type_name(value)} {shorten(value)}")
        return value

    def text(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            self.fail(f"{path} must be a string, got {type_name(value)} {shorten(value)}")
        if len(value) > MAX_TEXT_CHARS:
            self.fail(f"{path} must be at most {MAX_TEXT_CHARS:,} characters, got {shorten(value)}")
        return value

    def texts(self, value: Any, path: str) -> list[str]:
        return [self.text(item, f"{path}[{index}]") for index, item in enumerate(self.list(value, path))]

    def mapping(self, value: Any, path: str, read) -> dict:
        """An object whose keys are strings and whose values pass `read(value, path)`."""
        for key, item in self.object(value, path).items():
            read(item, f"{path}[{shorten(key)}]")
        return value


def check_plan_data(data: dict, source: str) -> None:
    """Types, ranges and consistency of a plan read from JSON (or built by hand): raises
    PlanMismatchError naming the field, so that `show`, `Plan.load` and `parallelize(plan=...)`
    never meet a malformed plan deep in a report or in codegen."""
    fields = _PlanFields(source)
    for key in ("model", "model_fingerprint", "cluster", "cluster_fingerprint", "schedule", "recompute", "precision"):
        fields.text(fields.get(data, key, key, "" if key == "precision" else ...), key)
    num_devices = fields.integer(fields.get(data, "num_devices", "num_devices"), "num_devices")
    global_batch = fields.integer(fields.get(data, "global_batch", "global_batch"), "global_batch",
                                  maximum=MAX_GLOBAL_BATCH)
    mesh = _check_mesh(fields, fields.get(data, "mesh", "mesh"), num_devices)
    microbatch = fields.integer(fields.get(data, "microbatch_size", "microbatch_size"), "microbatch_size",
                                maximum=MAX_GLOBAL_BATCH)
    count = fields.integer(fields.get(data, "num_microbatches", "num_microbatches"), "num_microbatches",
                           maximum=MAX_GLOBAL_BATCH)
    if mesh["dp"] * microbatch * count != global_batch:
        fields.fail(f"dp x microbatch_size x num_microbatches = {mesh['dp']} x {microbatch} x {count} = "
                    f"{mesh['dp'] * microbatch * count}, but global_batch is {global_batch}")
    fields.integer(fields.get(data, "virtual_stages", "virtual_stages"), "virtual_stages", maximum=MAX_DEVICES)
    zero_stage = fields.integer(fields.get(data, "zero_stage", "zero_stage"), "zero_stage", minimum=0)  # choices: Plan
    unsound = _zero3_with_zero_bubble(data["schedule"], zero_stage)
    if unsound:
        fields.fail(f"it does not train correctly: {unsound}")
    ep = fields.integer(fields.get(data, "ep", "ep", 1), "ep", maximum=MAX_DEVICES)
    if mesh["dp"] % ep:
        fields.fail(f"ep={ep} does not divide mesh dp={mesh['dp']}: experts are split over groups of ep "
                    "data-parallel ranks")
    fields.texts(fields.get(data, "ep_params", "ep_params", []), "ep_params")
    stages = fields.list(fields.get(data, "stages", "stages"), "stages")
    if len(stages) != mesh["pp"]:
        fields.fail(f"stages lists {len(stages)} pipeline stages, but mesh pp is {mesh['pp']}")
    for index, stage in enumerate(stages):
        _check_stage(fields, stage, index)
    for key in ("placements", "param_placements", "param_roles"):
        fields.mapping(fields.get(data, key, key, {}), key, fields.text)
    fields.texts(fields.get(data, "input_placements", "input_placements", []), "input_placements")
    fields.texts(fields.get(data, "notes", "notes", []), "notes")
    for index, item in enumerate(fields.list(fields.get(data, "replicated_ops", "replicated_ops", []),
                                             "replicated_ops")):
        path = f"replicated_ops[{index}]"
        item = fields.list(item, path)
        if len(item) != 2:
            fields.fail(f"{path} must be [op name, count], got {shorten(item)}")
        fields.text(item[0], f"{path}[0]")
        fields.integer(item[1], f"{path}[1]", minimum=0, maximum=2**62)
    fields.object(fields.get(data, "search", "search", {}), "search")
    for flag in ("offload", "loss_parallel", "sequence_parallel"):
        if not isinstance(fields.get(data, flag, flag, False), bool):
            fields.fail(f"{flag} must be true or false, got {shorten(data[flag])}")
    for index, row in enumerate(fields.list(fields.get(data, "trials", "trials", []), "trials")):
        fields.object(row, f"trials[{index}]")
    _check_prediction(fields, fields.get(data, "predicted", "predicted"))


def _check_mesh(fields: _PlanFields, mesh: Any, num_devices: int) -> dict[str, int]:
    fields.object(mesh, "mesh")
    for axis in MESH_AXES:
        if axis not in mesh:
            fields.fail(f"mesh {shorten(mesh)} lacks the axis '{axis}'; a mesh has pp, dp and tp")
        fields.integer(mesh[axis], f"mesh.{axis}")
    for axis in OPTIONAL_MESH_AXES:
        if axis in mesh:
            fields.integer(mesh[axis], f"mesh.{axis}")
    unknown = [axis for axis in mesh if axis not in MESH_AXES + OPTIONAL_MESH_AXES]
    if unknown:
        fields.fail(f"mesh has unknown axis {shorten(unknown[0])}; a mesh has pp, dp, tp and cp")
    cp = mesh.get("cp", 1)
    product = mesh["pp"] * mesh["dp"] * mesh["tp"] * cp
    if product != num_devices:
        shown = f"pp x dp x tp{' x cp' if cp != 1 else ''} = {mesh['pp']} x {mesh['dp']} x {mesh['tp']}" + \
            (f" x {cp}" if cp != 1 else "")
        fields.fail(f"mesh {shown} = {product}, but num_devices is {num_devices}")
    return mesh


def _check_stage(fields: _PlanFields, stage: Any, index: int) -> None:
    path = f"stages[{index}]"
    fields.object(stage, path)
    if fields.get(stage, "index", f"{path}.index") != index:
        fields.fail(f"{path}.index is {shorten(stage['index'])}; stages are listed in order from 0")
    fields.texts(fields.get(stage, "segments", f"{path}.segments"), f"{path}.segments")
    layers = fields.list(fields.get(stage, "layers", f"{path}.layers"), f"{path}.layers")
    if len(layers) != 2:
        fields.fail(f"{path}.layers must be [first, last + 1], got {shorten(layers)}")
    first, end = (fields.integer(value, f"{path}.layers", minimum=0, maximum=2**31) for value in layers)
    if end < first:
        fields.fail(f"{path}.layers [{first}, {end}] ends before it starts")
    for chunk_index, chunk in enumerate(fields.list(fields.get(stage, "chunks", f"{path}.chunks", []),
                                                    f"{path}.chunks")):
        fields.texts(chunk, f"{path}.chunks[{chunk_index}]")
    fields.text(fields.get(stage, "recompute", f"{path}.recompute", ""), f"{path}.recompute")
    fields.number(fields.get(stage, "time_per_microbatch_s", f"{path}.time_per_microbatch_s"),
                  f"{path}.time_per_microbatch_s")
    fields.number(fields.get(stage, "param_numel", f"{path}.param_numel"), f"{path}.param_numel")
    fields.mapping(fields.get(stage, "memory_bytes", f"{path}.memory_bytes"), f"{path}.memory_bytes", fields.number)
    for chunk_index, times in enumerate(fields.list(fields.get(stage, "chunk_times_s", f"{path}.chunk_times_s", []),
                                                    f"{path}.chunk_times_s")):
        fields.mapping(times, f"{path}.chunk_times_s[{chunk_index}]", fields.finite)
    fields.mapping(fields.get(stage, "collectives_per_microbatch", f"{path}.collectives_per_microbatch", {}),
                   f"{path}.collectives_per_microbatch", fields.number)


def _check_prediction(fields: _PlanFields, predicted: Any) -> None:
    fields.object(predicted, "predicted")
    for key in ("step_time_s", "peak_memory_bytes", "memory_budget_bytes", "model_flops_per_step"):
        fields.number(fields.get(predicted, key, f"predicted.{key}"), f"predicted.{key}")
    for key in ("tokens_per_s", "model_tflops_per_device", "expected_error"):
        fields.number(fields.get(predicted, key, f"predicted.{key}", 0.0), f"predicted.{key}")
    for key in ("breakdown_s", "memory_bytes", "collectives_per_microbatch", "host_memory_bytes"):
        fields.mapping(fields.get(predicted, key, f"predicted.{key}", {}), f"predicted.{key}", fields.number)
    if not isinstance(fields.get(predicted, "fits", "predicted.fits", True), bool):
        fields.fail(f"predicted.fits must be true or false, got {shorten(predicted['fits'])}")

"""Checks of a plan read from JSON (or built by hand): types, ranges and consistency, each error
naming the field by its path, so that `show`, `Plan.load` and `parallelize(plan=...)` never meet a
malformed plan deep in a report or in codegen."""

from __future__ import annotations

import math
from typing import Any

from autopar.errors import PlanMismatchError
from autopar.solver.constraints import zero3_with_zero_bubble
from autopar.validation import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_TEXT_CHARS, shorten, type_name


MESH_AXES = ("pp", "dp", "tp")
OPTIONAL_MESH_AXES = ("cp",)
"""Axes a plan's mesh may leave out (size 1): context parallelism came with schema version 2."""


class _PlanFields:
    """Typed reads of a plan's JSON, each error naming the field by its path (stages[0].layers)."""

    def __init__(self, source: str) -> None:
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
    for key in ("model", "model_fingerprint", "cluster", "cluster_fingerprint", "schedule", "recompute", "precision",
                "fp8_recipe", "fp8_casts", "calibration", "tp_overlap"):
        fields.text(fields.get(data, key, key, "" if key in ("precision", "calibration", "fp8_recipe", "fp8_casts")
                               else "off" if key == "tp_overlap" else ...), key)
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
    unsound = zero3_with_zero_bubble(data["schedule"], zero_stage)
    if unsound:
        fields.fail(f"it does not train correctly: {unsound}")
    ep = fields.integer(fields.get(data, "ep", "ep", 1), "ep", maximum=MAX_DEVICES)
    etp = data.get("etp")
    if etp is not None and fields.integer(etp, "etp", maximum=MAX_DEVICES) not in (1, mesh["tp"]):
        fields.fail(f"etp={etp} must be 1 (MoE parallel folding) or tp={mesh['tp']}")
    if etp == 1 and mesh["tp"] > 1 and (mesh["tp"] * mesh["dp"]) % ep:
        fields.fail(f"ep={ep} does not divide tp x dp = {mesh['tp']} x {mesh['dp']} (etp=1: the ep group is drawn "
                    "from the tp x dp ranks)")
    elif not (etp == 1 and mesh["tp"] > 1) and mesh["dp"] % ep:
        fields.fail(f"ep={ep} does not divide mesh dp={mesh['dp']}: experts are split over groups of ep "
                    "data-parallel ranks")
    fields.texts(fields.get(data, "ep_params", "ep_params", []), "ep_params")
    imbalance = data.get("moe_load_imbalance")
    if imbalance is not None and fields.number(imbalance, "moe_load_imbalance") < 1.0:
        fields.fail(f"moe_load_imbalance must be >= 1.0 (1.0: balanced routing), got {imbalance}")
    fields.texts(fields.get(data, "fp8_linears", "fp8_linears", []), "fp8_linears")
    fields.texts(fields.get(data, "fp8_experts", "fp8_experts", []), "fp8_experts")
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

"""The Plan: plain, versioned, JSON-serialisable data, and its readable report.

A plan names the model and cluster it was made for (with fingerprints, so that applying it to
another model fails clearly), the mesh, pipeline stages, the per-node placements on the tensor-
parallel axis, microbatching, schedule, recomputation and ZeRO stage, and the prediction: step
time with its breakdown and per-device memory with its breakdown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autopar.errors import PlanMismatchError
from autopar.plans.report import plan_summary
from autopar.plans.checks import check_plan_data
from autopar.validation import parse_json, read_text_file, shorten

SCHEMA_VERSION = 2
"""2: the mesh has a context-parallel axis "cp" (version 1 files load with cp = 1)."""
READABLE_VERSIONS = (1, 2)
CALIBRATIONS = ("", "calibrated", "uncalibrated", "datasheet")
"""Values of Plan.calibration."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage (one device's share of the model when pp > 1)."""

    index: int
    segments: tuple[str, ...]
    """Segments it runs: "prologue", block module paths ("layers.3"), "epilogue"."""
    layers: tuple[int, int]
    """[first, last + 1) of the repeated blocks it holds (equal when it holds none)."""
    chunks: tuple[tuple[str, ...], ...] = ()
    """Its model chunks in pipeline order (several with the interleaved schedule)."""
    recompute: str = ""
    """This stage's recomputation ("" means the plan's)."""
    time_per_microbatch_s: float
    param_numel: float
    """Parameters per device on this stage."""
    memory_bytes: dict[str, float]
    chunk_times_s: tuple[dict[str, float], ...] = ()
    """Per model chunk, one microbatch's exposed time by part: "forward", "backward", "recompute"
    (compute) and "<axis>.<collective>.<phase>" ("tp.all_reduce.forward", "pp.send_recv.backward");
    the parts of all chunks add up to time_per_microbatch_s (empty in plans from older versions)."""
    collectives_per_microbatch: dict[str, int] = field(default_factory=dict)
    """Tensor- and context-parallel collectives this stage's ranks run per microbatch, by kind
    (Prediction.collectives_per_microbatch counts the whole model; empty in older plans)."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    step_time_s: float
    breakdown_s: dict[str, float]
    """compute, recompute, tp.<collective>, pp.send_recv, bubble, optimizer, weight_cast (the step's
    bf16 copies of fp32 weights, without FSDP), gradient_accumulate (adding each microbatch's
    weight gradients into the fp32 ones), and the exposed
    data-parallel synchronisation: dp.gradient_sync (ZeRO 0) or dp.all_gather, dp.reduce_scatter
    (every microbatch) and dp.all_gather.once, dp.reduce_scatter.once (once per step); with
    optimizer offload offload.h2d, offload.d2h, offload.grad_accumulate and offload.cpu_adam."""
    peak_memory_bytes: float
    memory_bytes: dict[str, float]
    """parameters, gradients, optimizer, weight_copies (the step's bf16 copies of fp32 weights, without
    FSDP), activations, buffers, recompute_workspace, gradient_workspace, fsdp_unsharded,
    fragmentation, cuda_context (of the peak stage)."""
    memory_budget_bytes: float
    model_flops_per_step: float
    """Forward + backward matmul FLOPs of one step (no recomputation)."""
    tokens_per_s: float = 0.0
    collectives_per_microbatch: dict[str, int] = field(default_factory=dict)
    """Tensor-parallel collectives one microbatch's forward + backward runs, by kind."""
    fits: bool = True
    """Whether the peak stage fits in the memory budget."""
    expected_error: float = 0.0
    """Typical |predicted / measured - 1| of this prediction, from the profile's calibration
    residuals (held out); 0 when the profile has no calibration (error unknown)."""
    host_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Per device, model states kept in host memory under optimizer offload: host.parameters,
    host.gradients, host.optimizer (empty without offload)."""

    @property
    def model_flops_per_s(self) -> float:
        """Whole-cluster model FLOP/s (recomputation not counted)."""
        return self.model_flops_per_step / self.step_time_s if self.step_time_s else 0.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    schema_version: int
    model: str
    model_fingerprint: str
    cluster: str
    cluster_fingerprint: str
    num_devices: int
    global_batch: int
    mesh: dict[str, int]
    """{"pp": ..., "dp": ..., "cp": ..., "tp": ...}; laid out in that order with tp fastest (inside a
    node), then cp (context parallelism: each sequence split over cp ranks)."""
    microbatch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    recompute: str
    """Recomputation of the stage that needs the most (stages may need less: see stages)."""
    zero_stage: int
    offload: bool = False
    """Optimizer offload: FSDP2 CPUOffloadPolicy keeps sharded parameters, gradients and Adam
    states in host memory and steps the optimizer on the CPU (ZeRO-3, no pipeline)."""
    fsdp_root_ends: bool = False
    """Under FSDP2 with one pipeline stage: the stage's first and last segments (embedding, final
    norm and head) are the root unit's, not units of their own, and the last block stays gathered
    from its forward to its backward (cost_model/fsdp.py's "root ends"; the planner chooses it where
    they are small). Plans written before this field read as False."""
    loss_parallel: bool = False
    """The cross-entropy loss runs on logits sharded by class over tp (a vocabulary-parallel loss:
    DTensor's loss_parallel); the model output feeding it is not gathered."""
    sequence_parallel: bool = True
    """Whether the tp placements were allowed to shard activations by sequence where cheaper
    (Korthikanti et al.); False: tensor parallelism without sequence parallelism, as Megatron-LM
    runs without --sequence-parallel (norms, dropouts, residual adds replicated on the tp ranks,
    partial outputs all-reduced). Plans written before this field read as True."""
    pipeline_split: str = "balanced"
    """How the model was cut into pipeline chunks (solver/pipeline.py): "balanced" (autopar's cut),
    or by count as a framework cuts ("uniform", "uniform:embedding,head", "first=N,last=M", ...).
    The chunks themselves are in `stages`, which codegen builds; plans written before this field
    read as "balanced"."""
    stages: tuple[StagePlan, ...]
    placements: dict[str, str]
    """Per graph node on the tp axis: "output|input0;input1;..." (R, S<dim>, P)."""
    param_placements: dict[str, str]
    """Per parameter/buffer name, its placement on the tp axis."""
    param_roles: dict[str, str] = field(default_factory=dict)
    """Per parameter, how the op that reads it runs on the tp axis, e.g. "linear col"."""
    input_placements: tuple[str, ...] = ()
    """Placement on the tp axis of each model input, in order."""
    predicted: Prediction
    replicated_ops: tuple[tuple[str, int], ...] = ()
    search: dict[str, Any] = field(default_factory=dict)
    """How the plan was found: configurations priced, solver statistics, runners-up."""
    notes: tuple[str, ...] = ()
    precision: str = "bf16"
    """"bf16": bf16 compute, fp32 master weights and Adam; "fp32": fp32 throughout; "fp8": as
    "bf16", with the linears of `fp8_linears` run by torchao's float8 training (codegen/fp8.py)."""
    fp8_recipe: str = ""
    """precision "fp8": torchao's scaling recipe, "tensorwise" or "rowwise" ("" otherwise)."""
    fp8_linears: tuple[str, ...] = ()
    """precision "fp8": the weight FQNs of the linears run in float8 (solver/fp8.py's rule)."""
    fp8_experts: tuple[str, ...] = ()
    """precision "fp8": the expert weight FQNs whose grouped matmuls run in float8 (torchao's
    rowwise FP8 grouped GEMM, codegen/fp8_experts.py; solver/fp8.py's rule); the other expert
    weights' grouped matmuls stay bf16 (a note says why)."""
    fp8_casts: str = ""
    """precision "fp8": how the runtime runs the float8 casts, and how they were priced: "compiled"
    (torch.compile, codegen/fp8_compile.py) or "eager" (torchao op by op); "" otherwise (a plan
    written before this field ran and was priced eager)."""
    tp_overlap: str = "off"
    """How the runtime runs the sequence-parallel all-gathers and reduce-scatters of tensor
    parallelism, and how they were priced: "async" (fused with the GEMMs they feed, torch's async
    TP: codegen/async_tp.py; priced by solver/tp_overlap.py) or "off" (DTensor's collectives,
    exposed). "async" needs sequence parallelism and tp > 1; plans written before this field read "off"."""
    trials: tuple[dict[str, Any], ...] = ()
    """Trial runs that chose this plan among candidates (autopar.tune): per candidate its
    config, predicted_s, measured_s (None when it failed), error and chosen."""
    ep: int = 1
    """Expert-parallel degree: each group of ep consecutive dp ranks splits the expert weights
    (`ep_params`) by expert, exchanging tokens by all-to-all (1: no expert parallelism)."""
    ep_params: tuple[str, ...] = ()
    """The expert weights split over the ep group (dim 0, after their tensor-parallel placement)."""
    etp: int | None = None
    """Expert tensor-parallel degree: None, the experts on the tp solve (ep over dp ranks); 1 with
    tp > 1: MoE parallel folding (solver/expert_folding.py, run by codegen/expert_folding.py with
    cp = 1 and without module recomputation; parallelize refuses the others with the reason)."""
    moe_load_imbalance: float | None = None
    """Tokens the busiest expert-parallel rank of a dropless MoE layer was priced to receive and
    compute, over the even share (1.0: balanced routing; 1.25 by default); None: the model has no
    expert ops (or the plan predates this field)."""
    calibration: str = ""
    """What the step time was priced from (CALIBRATIONS): "calibrated" (a profile with a whole-step
    calibration for the cluster's processes per node: predicted.expected_error is its error bar),
    "uncalibrated" (a measured profile without one: single kernels and collectives only, which
    have ranked whole steps on CPUs poorly), "datasheet" (no profile: the preset's figures); ""
    in plans written before this field."""

    @property
    def model_tflops_per_device(self) -> float:
        return self.predicted.model_flops_per_s / max(self.num_devices, 1) / 1e12

    # --- serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["predicted"]["model_tflops_per_device"] = self.model_tflops_per_device
        return data

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<plan>") -> "Plan":
        if not isinstance(data, dict):
            raise PlanMismatchError(f"plan {shorten(source)} is not a JSON object (got {type(data).__name__}): give "
                                    "the file `autopar plan --out` wrote")
        if data.get("schema_version") not in READABLE_VERSIONS:
            raise PlanMismatchError(f"plan {shorten(source)} has schema_version {shorten(data.get('schema_version'))}; "
                                    f"this autopar reads versions {', '.join(map(str, READABLE_VERSIONS))}: re-run "
                                    "`autopar plan`")
        check_plan_data(data, source)
        if isinstance(data.get("mesh"), dict) and "cp" not in data["mesh"]:  # version 1: no context parallelism
            data = {**data, "mesh": {**data["mesh"], "cp": 1}}
        try:
            predicted_fields = {f.name for f in fields(Prediction)}
            predicted = Prediction(**{k: v for k, v in data["predicted"].items() if k in predicted_fields})
            stages = tuple(StagePlan(**{**stage, "segments": tuple(stage["segments"]), "layers": tuple(stage["layers"]),
                                        "chunks": tuple(tuple(chunk) for chunk in stage.get("chunks", ())),
                                        "chunk_times_s": tuple(stage.get("chunk_times_s", ()))})
                           for stage in data["stages"])
            values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            values.update(schema_version=SCHEMA_VERSION, predicted=predicted, stages=stages, input_placements=tuple(data.get("input_placements", ())),
                          replicated_ops=tuple(tuple(item) for item in data.get("replicated_ops", ())),
                          notes=tuple(data.get("notes", ())), trials=tuple(data.get("trials", ())),
                          ep_params=tuple(data.get("ep_params", ())), fp8_linears=tuple(data.get("fp8_linears", ())),
                          fp8_experts=tuple(data.get("fp8_experts", ())))
            plan = cls(**values)
        except (KeyError, TypeError) as error:
            raise PlanMismatchError(f"plan {shorten(source)} is missing or has a malformed field ({error}); "
                                    "re-run `autopar plan`") from None
        plan._check_choices(source)
        return plan

    def _check_choices(self, source: str) -> None:
        """Fields that name a choice must name a known one (a hand-edited plan may not)."""
        from autopar.solver.fp8 import FP8_CASTS, FP8_RECIPES
        from autopar.solver.step_model import RECOMPUTE_MODES, SCHEDULES

        choices = [("schedule", self.schedule, ("none",) + SCHEDULES), ("recompute", self.recompute, RECOMPUTE_MODES),
                   ("zero_stage", self.zero_stage, (0, 1, 2, 3)), ("precision", self.precision, ("bf16", "fp32", "fp8")),
                   ("fp8_recipe", self.fp8_recipe, ("",) + FP8_RECIPES if self.precision == "fp8" else ("",)),
                   ("fp8_casts", self.fp8_casts, ("",) + FP8_CASTS if self.precision == "fp8" else ("",)),
                   ("tp_overlap", self.tp_overlap, ("off", "async") if self.sequence_parallel and self.mesh.get("tp", 1) > 1
                    else ("off",)),
                   ("offload", self.offload, (False, True)), ("fsdp_root_ends", self.fsdp_root_ends, (False, True)),
                   ("sequence_parallel", self.sequence_parallel, (False, True)),
                   ("calibration", self.calibration, CALIBRATIONS)]
        choices += [(f"stages[{i}].recompute", stage.recompute, ("",) + RECOMPUTE_MODES)
                    for i, stage in enumerate(self.stages)]
        from autopar.errors import ConfigError
        from autopar.solver.pipeline import check_pipeline_split

        try:
            check_pipeline_split(self.pipeline_split)
        except ConfigError as error:
            raise PlanMismatchError(f"plan {shorten(source)}: {error}; fix the file or re-run `autopar plan`") from None
        for name, value, allowed in choices:
            if value not in allowed and not (name.endswith("recompute") and _known_parametrised_mode(value)):
                raise PlanMismatchError(f"plan {shorten(source)} has {name}={shorten(value)}; expected one of "
                                        f"{', '.join(repr(a) for a in allowed)}: fix the file or re-run `autopar plan`")
        gathers = [name for name, value in [("recompute", self.recompute)] + [
            (f"stages[{i}].recompute", stage.recompute) for i, stage in enumerate(self.stages)] if value == "gathers"]
        if gathers and not self.sequence_parallel:
            raise PlanMismatchError(f"plan {shorten(source)} has {gathers[0]}='gathers' with sequence_parallel=false: "
                                    "'gathers' re-gathers sequence-parallel shards, and this plan has none; fix the "
                                    "file or re-run `autopar plan`")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read and validate a plan file (types, ranges, mesh product, batch arithmetic)."""
        text = read_text_file(path, "plan", error=PlanMismatchError)
        data = parse_json(text, str(path), "plan", error=PlanMismatchError)
        return cls.from_dict(data, source=str(path))

    def validate(self, source: str = "<plan>") -> "Plan":
        """The checks of `load`, for a plan built or changed in Python; returns the plan."""
        check_plan_data(asdict(self), source)
        self._check_choices(source)
        return self

    # --- checks ------------------------------------------------------------------------------

    def stage_recompute(self, index: int) -> str:
        return (self.stages[index].recompute if index < len(self.stages) else "") or self.recompute

    def check_matches(self, *, model_fingerprint: str, num_devices: int, model_name: str = "") -> None:
        """Raise PlanMismatchError when applied to another model or world size."""
        if model_fingerprint != self.model_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for model '{self.model}' (fingerprint {self.model_fingerprint}), not for "
                f"{model_name or 'this model'} (fingerprint {model_fingerprint}): plan the model you run")
        if num_devices != self.num_devices:
            raise PlanMismatchError(f"this plan is for {self.num_devices} devices (mesh {self.mesh}), but the job "
                                    f"has {num_devices}: launch {self.num_devices} processes or re-plan")

    def summary(self) -> str:
        return plan_summary(self)


def _known_parametrised_mode(value) -> bool:
    """A well-formed "modules:<kinds>" or "blocks:<N>" recomputation mode (solver/recompute_modules.py,
    solver/recompute_blocks.py)."""
    from autopar.errors import ConfigError
    from autopar.solver.recompute_blocks import is_blocks_mode
    from autopar.solver.recompute_modules import check_recompute, is_modules_mode

    try:
        return (is_modules_mode(value) or is_blocks_mode(value)) and check_recompute(value) == value
    except ConfigError:
        return False

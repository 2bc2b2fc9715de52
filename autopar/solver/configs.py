"""A configuration of one training step (ParallelConfig) and what the step model says of it
(StageEstimate, Estimate): plain data, read by the step model (step_model.py) and its FSDP and
tail terms (step_fsdp.py, step_tail.py), which it inherits, without importing it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.solver.pipeline import StageSpan
from cost_model.fsdp import FsdpTimeline

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb1p", "zbv")
ZERO_BUBBLE_SCHEDULES = ("zb1p", "zbv")
"""Schedules that split the backward into input- and weight-gradient passes."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A fully fixed parallelization of one training step."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Model chunks per device for the interleaved and zb1p schedules (2 for zbv, 1 otherwise)."""
    recompute: str = "none"
    zero_stage: int = 0
    ep: int = 1
    """Expert-parallel degree: experts split over groups of ep consecutive dp ranks (divides dp),
    or with etp = 1 and tp > 1 over ep consecutive ranks of the tp x dp grid (divides tp x dp)."""
    etp: int | None = None
    """Expert tensor-parallel degree (solver/expert_folding.py): None or tp, the experts follow
    the intra-op solve on tp (today's layout); 1 with tp > 1 and ep > 1, folded: experts unsplit
    by tp, each tp rank runs the MoE layers on its own sequence-parallel rows."""
    cp: int = 1
    """Context parallelism: ranks each sequence is split over (solver/context_parallel.py)."""

    @property
    def data_shards(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def folds_experts(self) -> bool:
        """MoE parallel folding: etp = 1 with tp > 1 and ep > 1 (solver/expert_folding.py)."""
        return self.tp > 1 and self.ep > 1 and self.etp == 1

    @property
    def expert_data_shards(self) -> int:
        """Ranks holding the same experts (their gradients reduced, FSDP-sharded over them): the
        data shards / ep, or folded the tp x data shards / ep."""
        return self.data_shards * (self.tp if self.folds_experts else 1) // max(self.ep, 1)

    offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host memory
    and the optimizer step on the CPU (ZeRO-3 without pipelining)."""
    sequence_parallel: bool = True
    """Whether the tp solution may shard activations beyond what sharded weights make them
    (Korthikanti et al.'s sequence parallelism, where cheaper); False: Megatron-LM's tensor
    parallelism without it (solver/sharding_problem.py). Meaningless with tp = 1."""
    pipeline_split: str = "balanced"
    """How the model is cut into pipeline chunks (solver/pipeline.py): "balanced", autopar's cut (the
    slowest stage as fast as memory allows), or by count as the frameworks cut: "uniform" (equal
    repeated blocks per chunk, the embedding on the first, head and loss on the last),
    "uniform:embedding" / "uniform:head" / "uniform:embedding,head" (those counted as a block each),
    "first=N,last=M" (blocks of the first and last chunk, the rest even)."""

    @property
    def chunks_per_device(self) -> int:
        return chunks_per_device(self.schedule, self.virtual_stages)

    @property
    def num_chunks(self) -> int:
        """Model chunks of the whole pipeline: pp x chunks per device."""
        return self.pp * self.chunks_per_device

    def describe(self) -> str:
        shown = self.schedule in ("interleaved", "zb1p") and self.virtual_stages > 1
        schedule = self.schedule + (f"(v={self.virtual_stages})" if shown else "")
        experts = f" ep={self.ep}" + (" etp=1" if self.folds_experts else "") if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"dp={self.dp}{experts}{cp} tp={self.tp} pp={self.pp} microbatch={self.microbatch_size}x"
                f"{self.num_microbatches} {schedule} recompute={self.recompute} zero={self.zero_stage}"
                + (" offload" if self.offload else "") + (" no-sp" if self.tp > 1 and not self.sequence_parallel else "")
                + (f" split={self.pipeline_split}" if self.pp > 1 and self.pipeline_split != "balanced" else ""))


def chunks_per_device(schedule: str, virtual_stages: int) -> int:
    """Model chunks one pipeline rank runs under `schedule`."""
    if schedule in ("interleaved", "zb1p"):
        return virtual_stages
    return 2 if schedule == "zbv" else 1


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    index: int
    span: StageSpan
    segment_names: tuple[str, ...]
    chunks: tuple[tuple[str, ...], ...]
    """Segment names per model chunk of this device, in pipeline order."""
    time_per_microbatch_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: dict[str, float]
    p2p_s: float
    param_numel: float
    memory_bytes: dict[str, float]
    p2p_hidden_s: float = 0.0
    """Of p2p_s, what the steady state runs beside compute (solver/p2p_overlap.py): not in
    time_per_microbatch_s, but in the fill and flush of the pipeline."""
    forward_pass_s: float = 0.0
    """One microbatch's forward pass: compute, forward collectives, half the sends (the F of the
    zero-bubble schedules)."""
    weight_grad_s: float = 0.0
    """One microbatch's weight-gradient compute (the W of the zero-bubble schedules)."""
    grad_reduce_s: float = 0.0
    """Reductions of Partial weight gradients, once per step after the last microbatch (prepared.py)."""
    fused_wgrad_numel: float = 0.0
    """Of param_numel, the weights whose gradients accumulate inside their GEMMs in this
    configuration (codegen/fused_wgrad.py): no cast or add per microbatch."""
    shared_held: tuple[bool, ...] = ()
    """Per StepModel.shared_params entry, whether this rank holds a copy (it reads the weight)."""
    host_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Model states kept in host memory (optimizer offload)."""
    offload_s: dict[str, float] = field(default_factory=dict)
    """Exposed offload copies per microbatch, by term (included in time_per_microbatch_s)."""
    recompute: str = "none"
    """This stage's recomputation (stages with fewer microbatches in flight may need less)."""
    fsdp: FsdpTimeline | None = None
    """One microbatch's FSDP2 communication on this stage (ZeRO >= 1 with dp > 1)."""
    fsdp_exposed_s: dict[str, float] = field(default_factory=dict)
    """Exposed FSDP2 communication per microbatch, by collective (included in time_per_microbatch_s)."""
    fsdp_step_end_s: dict[str, float] = field(default_factory=dict)
    """Exposed FSDP2 communication once per step, by collective (ZeRO-1/2 gathers, reductions
    made only in the last microbatch)."""
    expert_param_numel: float = 0.0
    """Of param_numel, the expert weights this device holds (1/ep of them)."""
    ep_s: dict[str, float] = field(default_factory=dict)
    """Expert parallelism per microbatch (in time_per_microbatch_s): all-to-alls by part ("dispatch",
    "combine", "counts") and "load_imbalance"."""
    ep_segment_s: tuple[tuple[str, float, float], ...] = ()
    """Per segment with expert ops: (name, forward, backward) seconds of expert parallelism."""

    @property
    def total_memory_bytes(self) -> float:
        return sum(self.memory_bytes.values())


@dataclass(frozen=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    breakdown_s: dict[str, float]
    stages: tuple[StageEstimate, ...]
    peak_memory_bytes: float
    memory_bytes: dict[str, float]
    """Breakdown of the stage with the peak."""
    fits: bool
    host_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Model states in host memory per device under optimizer offload (of the peak stage)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

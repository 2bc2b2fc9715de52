"""The timeline of one training step, laid out from the plan's own step model.

Every pipeline rank runs its passes in the order of the plan's schedule (schedules.py). A pass
lasts what the step model priced for that stage and model chunk (`StagePlan.chunk_times_s`):

    forward    forward compute + its tensor-parallel collectives + the send to the next stage
    recompute  the recomputed forward (selective: parameter-free ops; full: all, collectives too),
               run right before the backward of the same microbatch
    backward   backward compute + its collectives + the send of the gradient to the previous stage
               (under the zero-bubble schedules only the input gradient)
    weight     the weight gradient, a pass of its own under the zero-bubble schedules (zb1p, zbv)

A forward waits for the same microbatch's forward on the previous pipeline stage, a backward for
the next stage's backward (the last stage: its own forward), a weight pass for its own backward
(earlier on the same rank). Which rank runs which stage follows the schedule's layout (loop, or
ZB-V's V: solver/pipeline.py). Idle time on a rank before its last
pass is bubble. After the pipeline every rank runs what the step model adds once per step: the
exposed data-parallel synchronisation, the tied-weight all-reduce and the optimizer step.

The layout is data (`Timeline`): the PNG and HTML pictures draw it, and tests check it. Its
length is the simulated schedule plus the step tail; `mismatch` says how far it is from the
predicted step time (the step model's closed forms, step_model.py, are exact for identical stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import PlanMismatchError
from autopar.plans.plan import Plan
from autopar.solver.schedule_sim import lay_out

PASS_KINDS = ("forward", "recompute", "backward", "weight")
TAIL_KINDS = ("dp.gradient_sync", "dp.all_gather.once", "dp.all_gather.sm_contention.once", "dp.reduce_scatter.once",
              "dp.reduce_scatter.sm_contention.once", "pp.tied_weights", "optimizer",
              "offload.cpu_adam", "weight_cast", "gradient_accumulate")
"""What the step model adds after the pipeline, in the order it is drawn (weight_cast, the step's
bf16 weight copies, runs before the first forward: it is drawn last, as the next step's start;
gradient_accumulate is spread over the backward passes: drawn as a sum)."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """One drawn interval on one pipeline rank."""

    rank: int
    """Pipeline rank (stage index)."""
    kind: str
    """"forward", "recompute", "backward", "weight", "bubble", or a step-tail term (TAIL_KINDS)."""
    start_s: float
    duration_s: float
    microbatch: int = -1
    """Microbatch index (-1 for bubbles and the step tail)."""
    chunk: int = -1
    """Model chunk on this rank, 0 .. chunks - 1 (-1 for bubbles and the step tail)."""
    comm_s: dict[str, float] = field(default_factory=dict)
    """Exposed collectives inside the block by "<axis>.<collective>" (tp.all_reduce, pp.send_recv)."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, kw_only=True)
class Timeline:
    schedule: str
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    """Model chunks per rank (the interleaved and zb1p schedules' v, 2 for zbv; 1 otherwise)."""
    blocks: tuple[Block, ...]
    """Passes and the step tail."""
    bubbles: tuple[Block, ...]
    pipeline_end_s: float
    end_s: float
    """Drawn length: the last pass on any rank plus the step tail."""
    predicted_step_time_s: float

    @property
    def mismatch(self) -> float:
        """Relative difference of the drawn length from the predicted step time."""
        return self.end_s / self.predicted_step_time_s - 1 if self.predicted_step_time_s else 0.0

    def on_rank(self, rank: int, kinds: tuple[str, ...] | None = None) -> list[Block]:
        return [block for block in self.blocks + self.bubbles
                if block.rank == rank and (kinds is None or block.kind in kinds)]

    def bubble_s(self, rank: int) -> float:
        return sum(block.duration_s for block in self.bubbles if block.rank == rank)


def layout(plan: Plan) -> Timeline:
    """Lay out the plan's step (see the module docstring)."""
    num_ranks = plan.mesh["pp"]
    num_chunks = chunks_per_rank(plan.schedule, plan.virtual_stages)
    durations = [_pass_times(plan, rank, num_chunks) for rank in range(num_ranks)]
    passes = _simulate(plan.schedule, durations, num_ranks, plan.num_microbatches, num_chunks)
    pipeline_end = max((block.end_s for block in passes), default=0.0)
    tail, end = [], pipeline_end
    for kind in TAIL_KINDS:
        seconds = plan.predicted.breakdown_s.get(kind, 0.0)
        if seconds > 0:
            tail += [Block(rank=rank, kind=kind, start_s=end, duration_s=seconds) for rank in range(num_ranks)]
            end += seconds
    return Timeline(schedule=plan.schedule, num_ranks=num_ranks, num_microbatches=plan.num_microbatches,
                    num_chunks=num_chunks, blocks=tuple(passes + tail),
                    bubbles=tuple(_bubbles(passes, num_ranks, pipeline_end)), pipeline_end_s=pipeline_end,
                    end_s=end, predicted_step_time_s=plan.predicted.step_time_s)


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    if schedule in ("interleaved", "zb1p"):
        return virtual_stages
    return 2 if schedule == "zbv" else 1


@dataclass(frozen=True)
class _Pass:
    seconds: float
    comm_s: dict[str, float]


def _pass_times(plan: Plan, rank: int, num_chunks: int) -> list[dict[str, _Pass]]:
    """Per local chunk of `rank`: the duration and collectives of each pass kind."""
    stage = plan.stages[rank] if rank < len(plan.stages) else None
    if stage is None or len(stage.chunk_times_s) != num_chunks:
        raise PlanMismatchError(f"plan stage {rank} has no per-chunk times (made by an older autopar?): "
                                "re-run `autopar plan` to draw its timeline")
    chunks = []
    for parts in stage.chunk_times_s:
        passes = {}
        for kind in PASS_KINDS:
            comm = {key.rsplit(".", 1)[0]: seconds for key, seconds in parts.items()
                    if key.endswith(f".{kind}") and seconds > 0}
            passes[kind] = _Pass(parts.get(kind, 0.0) + sum(comm.values()), comm)
        chunks.append(passes)
    return chunks


def _simulate(schedule: str, durations, num_ranks: int, num_microbatches: int, num_chunks: int) -> list[Block]:
    """Every rank's pass order laid out as early as its dependencies allow (solver/schedule_sim.py),
    each pass drawn as its parts."""
    schedule = schedule if num_ranks > 1 else "1f1b"
    # Schedules that do not split the backward have no "weight" part: it is inside "backward".
    names = {"F": ("forward",), "B": ("recompute", "backward"), "W": ("weight",)}
    blocks: list[Block] = []

    def run(rank: int, kind: str, chunk: int, microbatch: int, start: float) -> float:
        passes = durations[rank][chunk]
        for name in names[kind]:
            if name in ("recompute", "weight") and passes[name].seconds <= 0:
                continue
            blocks.append(Block(rank=rank, kind=name, start_s=start, duration_s=passes[name].seconds,
                                microbatch=microbatch, chunk=chunk, comm_s=passes[name].comm_s))
            start += passes[name].seconds
        return start

    lay_out(schedule, num_ranks, num_microbatches, num_chunks, run)
    return blocks


def _bubbles(passes: list[Block], num_ranks: int, pipeline_end_s: float) -> list[Block]:
    """Idle intervals of each rank before the pipeline ends."""
    bubbles = []
    tolerance = 1e-9 * pipeline_end_s
    for rank in range(num_ranks):
        cursor = 0.0
        for block in sorted((b for b in passes if b.rank == rank), key=lambda b: b.start_s):
            if block.start_s - cursor > tolerance:
                bubbles.append(Block(rank=rank, kind="bubble", start_s=cursor, duration_s=block.start_s - cursor))
            cursor = max(cursor, block.end_s)
        if pipeline_end_s - cursor > tolerance:
            bubbles.append(Block(rank=rank, kind="bubble", start_s=cursor, duration_s=pipeline_end_s - cursor))
    return bubbles

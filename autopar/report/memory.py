"""Memory per pipeline stage, as the plan's step model priced it: the data the memory picture
draws (one stacked bar per stage against the usable-memory line)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plans.plan import Plan

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "weight_copies", "activations", "buffers", "recompute_workspace",
                "gradient_workspace",
                "fsdp_unsharded", "fragmentation", "cuda_context")


@dataclass(frozen=True, kw_only=True)
class MemoryBar:
    stage: int
    parts_bytes: dict[str, float]
    """Per device of this stage, in MEMORY_PARTS order (parts the plan does not name come last)."""
    recompute: str
    """This stage's recomputation."""

    @property
    def total_bytes(self) -> float:
        return sum(self.parts_bytes.values())


@dataclass(frozen=True, kw_only=True)
class MemoryChart:
    bars: tuple[MemoryBar, ...]
    usable_bytes: float
    """The plan's memory budget per device (device memory x the usable fraction)."""

    def margin_bytes(self, stage: int) -> float:
        """Room left under the usable line (negative: over budget)."""
        return self.usable_bytes - self.bars[stage].total_bytes

    @property
    def peak_stage(self) -> int:
        return max(range(len(self.bars)), key=lambda index: self.bars[index].total_bytes)


def memory_layout(plan: Plan) -> MemoryChart:
    bars = []
    for stage in plan.stages:
        order = list(MEMORY_PARTS) + [name for name in stage.memory_bytes if name not in MEMORY_PARTS]
        parts = {name: float(stage.memory_bytes.get(name, 0.0)) for name in order}
        bars.append(MemoryBar(stage=stage.index, parts_bytes=parts, recompute=plan.stage_recompute(stage.index)))
    return MemoryChart(bars=tuple(bars), usable_bytes=plan.predicted.memory_budget_bytes)

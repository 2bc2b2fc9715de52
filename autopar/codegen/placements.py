"""Plan placement strings <-> DTensor placements, and the redistribution the plan asks for."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


def to_dtensor_placement(text: str) -> Placement:
    """"R" -> Replicate(), "S<d>" -> Shard(d), "P" -> Partial() (sum)."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S"):
        return Shard(int(text[1:]))
    raise ValueError(f"unknown placement '{text}' in plan (expected R, S<dim> or P)")


def to_plan_placement(placement: Placement) -> str:
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    return repr(placement)


def same_placement(placement: Placement, text: str) -> bool:
    """Partial(sum) and Partial(avg) both count as the plan's "P"."""
    return to_plan_placement(placement) == text


def parse_node_placements(text: str) -> tuple[str, list[str]]:
    """"S2|R;S0;S0" -> ("S2", ["R", "S0", "S0"]) for a one-axis (tp) plan."""
    output, _, inputs = text.partition("|")
    return output, [item for item in inputs.split(";")] if inputs else []


def current(value: DTensor) -> str:
    return to_plan_placement(value.placements[0])

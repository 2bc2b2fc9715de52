"""`autopar diff A.json B.json`: what two plans choose differently, and what each predicts.

Settings (model, cluster, mesh, microbatching, schedule, recomputation, ZeRO, precision), the
pipeline stages, the per-weight placements on the tensor-parallel axis (weights of identical
blocks that change alike are folded into one line, "layers.*.mlp.fc_in.weight x96"), and the
predicted step time, its terms and the peak memory of each side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.validation import human_bytes
from autopar.plans.report import _chunk_text
from autopar.plans.plan import Plan

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


@dataclass(frozen=True, kw_only=True)
class PlanDiff:
    settings: tuple[tuple[str, str, str], ...]
    """(name, A's value, B's value) for each setting that differs."""
    stages: tuple[tuple[int, str, str], ...]
    """(stage, A's, B's) for each pipeline stage whose layers or recomputation differ."""
    placements: tuple[tuple[str, str, str, int], ...]
    """(weight or folded pattern, A's placement, B's, how many weights) that differ."""
    predicted: tuple[tuple[str, str, float, float], ...]
    """(term, unit, A, B) of the prediction: step time, tokens/s, its terms, peak memory."""

    @property
    def same_choices(self) -> bool:
        return not (self.settings or self.stages or self.placements)


def _settings(plan: Plan) -> dict[str, str]:
    schedule = plan.schedule + (f" (v={plan.virtual_stages})" if plan.schedule in ("interleaved", "zb1p") else "")
    return {"model": plan.model, "cluster": plan.cluster, "devices": str(plan.num_devices),
            "global batch": str(plan.global_batch),
            "mesh": f"pp={plan.mesh['pp']} dp={plan.mesh['dp']} tp={plan.mesh['tp']}"
                    + (f" cp={plan.mesh['cp']}" if plan.mesh.get("cp", 1) > 1 else "")
                    + (f" ep={plan.ep}" if plan.ep > 1 else ""),
            "microbatches": f"{plan.num_microbatches} of {plan.microbatch_size}", "schedule": schedule,
            "recompute": plan.recompute, "ZeRO stage": str(plan.zero_stage), "precision": plan.precision,
            "sequence parallel": _sequence_parallel(plan)}


def _sequence_parallel(plan: Plan) -> str:
    if plan.mesh["tp"] == 1:
        return "- (tp=1)"
    return "allowed" if plan.sequence_parallel else "off (all-reduce)"


def _stage_text(plan: Plan, index: int) -> str:
    if index >= len(plan.stages):
        return "-"
    stage = plan.stages[index]
    text = "; ".join(_chunk_text(chunk) for chunk in (stage.chunks or (stage.segments,)))
    return f"{text} (recompute {plan.stage_recompute(index)})"


def _folded_placements(a: Plan, b: Plan) -> list[tuple[str, str, str, int]]:
    groups: dict[tuple[str, str, str], int] = {}
    for name in list(dict.fromkeys(list(a.param_placements) + list(b.param_placements))):
        left, right = a.param_placements.get(name, "-"), b.param_placements.get(name, "-")
        if left != right:
            key = (_INDEX.sub("*", name), left, right)
            groups[key] = groups.get(key, 0) + 1
    return [(pattern, left, right, count) for (pattern, left, right), count in groups.items()]


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    left, right = _settings(a), _settings(b)
    settings = tuple((name, left[name], right[name]) for name in left if left[name] != right[name])
    stages = tuple((index, _stage_text(a, index), _stage_text(b, index))
                   for index in range(max(len(a.stages), len(b.stages)))
                   if _stage_text(a, index) != _stage_text(b, index))
    predicted = [("step time", "s", a.predicted.step_time_s, b.predicted.step_time_s),
                 ("tokens/s", "/s", a.predicted.tokens_per_s, b.predicted.tokens_per_s)]
    terms = list(dict.fromkeys(list(a.predicted.breakdown_s) + list(b.predicted.breakdown_s)))
    predicted += [(f"  {term}", "s", a.predicted.breakdown_s.get(term, 0.0), b.predicted.breakdown_s.get(term, 0.0))
                  for term in terms]
    predicted.append(("peak memory", "bytes", a.predicted.peak_memory_bytes, b.predicted.peak_memory_bytes))
    parts = list(dict.fromkeys(list(a.predicted.memory_bytes) + list(b.predicted.memory_bytes)))
    predicted += [(f"  {part}", "bytes", a.predicted.memory_bytes.get(part, 0.0), b.predicted.memory_bytes.get(part, 0.0))
                  for part in parts]
    return PlanDiff(settings=settings, stages=stages, placements=tuple(_folded_placements(a, b)),
                    predicted=tuple(row for row in predicted if row[2] or row[3]))


def _value(value: float, unit: str) -> str:
    if unit == "bytes":
        return human_bytes(value)
    return f"{value:,.0f}" if unit == "/s" else f"{value:.4g} s"


def diff_text(a: Plan, b: Plan, *, names: tuple[str, str] = ("A", "B"), max_placements: int = 24) -> str:
    found = diff_plans(a, b)
    lines = [f"autopar diff: A = {names[0]}, B = {names[1]}"]
    if found.same_choices:
        lines.append("  the plans make the same choices (settings, stages and placements)")
    if found.settings:
        lines.append("  settings:")
        width = max(len(name) for name, _, _ in found.settings)
        lines += [f"    {name:<{width}}  A {left:<28} B {right}" for name, left, right in found.settings]
    if found.stages:
        lines.append("  pipeline stages:")
        for index, left, right in found.stages:
            label = f"stage {index}"
            lines += [f"    {label:<9} A {left}", f"    {'':<9} B {right}"]
    if found.placements:
        lines.append(f"  tensor-parallel placements that differ ({sum(p[3] for p in found.placements)} weights):")
        width = max(len(pattern) for pattern, *_ in found.placements[:max_placements])
        for pattern, left, right, count in found.placements[:max_placements]:
            lines.append(f"    {pattern:<{width}}  A {left:<5} B {right:<5}" + (f" x{count}" if count > 1 else ""))
        if len(found.placements) > max_placements:
            lines.append(f"    ... {len(found.placements) - max_placements} more")
    lines.append("  predicted:")
    width = max(len(term) for term, *_ in found.predicted)
    for term, unit, left, right in found.predicted:
        change = f"({100 * (right / left - 1):+.1f}%)" if left else ""
        lines.append(f"    {term:<{width}}  A {_value(left, unit):>12}   B {_value(right, unit):>12}  {change}")
    return "\n".join(lines)


def diff_dict(a: Plan, b: Plan) -> dict:
    found = diff_plans(a, b)
    return {"settings": [{"name": n, "a": x, "b": y} for n, x, y in found.settings],
            "stages": [{"stage": i, "a": x, "b": y} for i, x, y in found.stages],
            "placements": [{"weight": w, "a": x, "b": y, "count": c} for w, x, y, c in found.placements],
            "predicted": [{"term": t.strip(), "unit": u, "a": x, "b": y} for t, u, x, y in found.predicted]}

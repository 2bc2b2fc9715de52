"""`autopar explain`: why this plan and not the runners-up.

For each of the best few alternatives the search ranked (stored in the plan), which settings
differ, and which terms of the step time and of the peak stage's memory differ and by how much,
in one table: the chosen plan's value, then each alternative's difference from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.validation import human_bytes
from autopar.plans.plan import Plan

SETTINGS = ("pp", "dp", "cp", "tp", "microbatch_size", "num_microbatches", "schedule", "virtual_stages", "recompute",
            "zero_stage", "ep", "etp", "offload")


@dataclass(frozen=True, kw_only=True)
class Alternative:
    label: str
    """"#1", "#2"... in the order the search ranked them."""
    config: str
    changes: tuple[str, ...]
    """Settings that differ from the chosen plan, as "pp 16 -> 8"."""
    step_time_s: float
    peak_memory_bytes: float
    breakdown_s: dict[str, float]
    memory_bytes: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class Row:
    term: str
    unit: str
    """"s" or "bytes"."""
    chosen: float
    deltas: tuple[float | None, ...]
    """Alternative minus chosen, per alternative (None: the plan does not record that term)."""


@dataclass(frozen=True, kw_only=True)
class Explanation:
    chosen_config: str
    alternatives: tuple[Alternative, ...]
    rows: tuple[Row, ...]

    def reasons(self, index: int, top: int = 3) -> list[tuple[str, float]]:
        """The time terms that most separate alternative `index` from the chosen plan."""
        terms = [(row.term, row.deltas[index]) for row in self.rows
                 if row.unit == "s" and row.term != "step time" and row.deltas[index]]
        return sorted(terms, key=lambda item: -abs(item[1]))[:top]


def plan_settings(plan: Plan) -> dict:
    return {"pp": plan.mesh["pp"], "dp": plan.mesh["dp"], "cp": plan.mesh.get("cp", 1), "tp": plan.mesh["tp"],
            "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
            "schedule": plan.schedule if plan.mesh["pp"] > 1 else "1f1b",
            "virtual_stages": plan.virtual_stages, "recompute": plan.recompute, "zero_stage": plan.zero_stage,
            "ep": plan.ep, "etp": plan.etp, "offload": plan.offload}


def describe_settings(settings: dict) -> str:
    schedule = settings["schedule"] + (f"(v={settings['virtual_stages']})" if settings["schedule"] in ("interleaved", "zb1p") else "")
    cp = f" cp={settings['cp']}" if settings.get("cp", 1) > 1 else ""
    experts = f" ep={settings['ep']}" if settings.get("ep", 1) > 1 else ""
    experts += " etp=1" if experts and settings.get("etp") == 1 and settings["tp"] > 1 else ""
    return (f"dp={settings['dp']}{experts}{cp} tp={settings['tp']} pp={settings['pp']} "
            f"microbatch={settings['microbatch_size']}x{settings['num_microbatches']} {schedule} "
            f"recompute={settings['recompute']} zero={settings['zero_stage']}"
            + (" offload" if settings.get("offload") else ""))


def explain(plan: Plan, *, max_alternatives: int = 3) -> Explanation:
    chosen = plan_settings(plan)
    alternatives = []
    for index, other in enumerate((plan.search.get("runners_up") or [])[:max_alternatives]):
        settings = other.get("settings") or {}
        changes = tuple(f"{name} {chosen[name]} -> {settings[name]}" for name in SETTINGS
                        if name in settings and settings[name] != chosen[name])
        alternatives.append(Alternative(label=f"#{index + 1}", config=other.get("config", ""), changes=changes,
                                        step_time_s=other["step_time_s"], peak_memory_bytes=other["peak_memory_bytes"],
                                        breakdown_s=dict(other.get("breakdown_s") or {}),
                                        memory_bytes=dict(other.get("memory_bytes") or {})))
    predicted = plan.predicted
    rows = [_row("step time", "s", predicted.step_time_s, [a.step_time_s for a in alternatives])]
    for term in _terms(predicted.breakdown_s, [a.breakdown_s for a in alternatives]):
        rows.append(_row(term, "s", predicted.breakdown_s.get(term, 0.0),
                         [a.breakdown_s.get(term, 0.0) if a.breakdown_s else None for a in alternatives]))
    rows.append(_row("peak memory", "bytes", predicted.peak_memory_bytes, [a.peak_memory_bytes for a in alternatives]))
    for term in _terms(predicted.memory_bytes, [a.memory_bytes for a in alternatives]):
        rows.append(_row(term, "bytes", predicted.memory_bytes.get(term, 0.0),
                         [a.memory_bytes.get(term, 0.0) if a.memory_bytes else None for a in alternatives]))
    return Explanation(chosen_config=describe_settings(chosen), alternatives=tuple(alternatives), rows=tuple(rows))


def _terms(chosen: dict[str, float], others: list[dict[str, float]]) -> list[str]:
    """Terms in the chosen plan's order, then the alternatives' own, skipping all-zero ones."""
    names = list(dict.fromkeys(list(chosen) + [name for other in others for name in other]))
    return [name for name in names if chosen.get(name, 0.0) or any(other.get(name, 0.0) for other in others)]


def _row(term: str, unit: str, chosen: float, values: list[float | None]) -> Row:
    return Row(term=term, unit=unit, chosen=chosen,
               deltas=tuple(None if value is None else value - chosen for value in values))


def format_value(value: float, unit: str) -> str:
    return f"{value:.4g} s" if unit == "s" else human_bytes(value)


def format_delta(delta: float | None, chosen: float, unit: str) -> str:
    if delta is None:
        return "?"
    if abs(delta) <= 1e-12 * max(abs(chosen), 1.0):
        return "="
    sign = "+" if delta > 0 else "-"
    size = f"{abs(delta):.3g} s" if unit == "s" else human_bytes(abs(delta))
    percent = f" ({100 * delta / chosen:+.1f}%)" if chosen else ""
    return f"{sign}{size}{percent}"


def explain_text(plan: Plan, *, max_alternatives: int = 3) -> str:
    explanation = explain(plan, max_alternatives=max_alternatives)
    lines = [f"autopar explain: {plan.model} on {plan.cluster}, global batch {plan.global_batch}",
             f"  chosen  {explanation.chosen_config}"]
    if plan.moe_load_imbalance is not None:
        lines.append(f"          MoE experts priced with load imbalance {plan.moe_load_imbalance:g} (ep.load_imbalance; "
                     "ep.dispatch, ep.combine, ep.counts are the all-to-alls, ep.reorder the rows sorted "
                     "between source-major and expert-major around them)")
    lines += [f"          {note}" for note in fp8_notes(plan)]
    if getattr(plan, "tp_overlap", "off") == "async":
        lines.append("          tp_overlap async: sequence-parallel all-gathers and reduce-scatters fused with their "
                     "GEMMs (torch's async TP), each priced hidden up to (tp-1)/tp of the GEMM beside it, "
                     "plus its kernel's memory pass (solver/tp_overlap.py, tp_windows.py; tp.sm_contention; "
                     "measured async TP gains ran below this price: docs/accuracy.md#async-tp)")
    if not explanation.alternatives:
        lines.append("  no runners-up recorded (a configuration priced with `autopar evaluate`, or the search "
                     "found only this one)")
    for alternative in explanation.alternatives:
        lines.append(f"  {alternative.label:<7} {alternative.config}")
        lines.append(f"          differs in: {', '.join(alternative.changes) or 'per-stage choices only'}")
    header = ["term", "chosen"] + [a.label for a in explanation.alternatives]
    table = [header] + [[_indented(row.term), format_value(row.chosen, row.unit)]
                        + [format_delta(d, row.chosen, row.unit) for d in row.deltas] for row in explanation.rows]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    lines.append("")
    for number, line in enumerate(table):
        lines.append("  " + "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                                      for i, cell in enumerate(line)))
        if number == 0:
            lines.append("  " + "  ".join("-" * width for width in widths))
    lines.append("")
    for index, alternative in enumerate(explanation.alternatives):
        reasons = explanation.reasons(index)
        slower = alternative.step_time_s - plan.predicted.step_time_s
        words = ", ".join(f"{term} {format_delta(delta, 0.0, 's')}" for term, delta in reasons)
        lines.append(f"  {alternative.label} is {abs(slower):.3g} s {'slower' if slower >= 0 else 'faster'}"
                     + (f": {words}" if words else ""))
    return "\n".join(lines)


def fp8_notes(plan: Plan) -> list[str]:
    """Precision "fp8": what float8 buys the chosen plan (solver/fp8_pricing.py's note)."""
    return [note for note in plan.notes if note.startswith("fp8 buys")] if plan.precision == "fp8" else []


def _indented(term: str) -> str:
    """Terms under their total ("step time", "peak memory")."""
    return term if term in ("step time", "peak memory") else f"  {term}"


def explain_dict(plan: Plan, *, max_alternatives: int = 3) -> dict:
    explanation = explain(plan, max_alternatives=max_alternatives)
    return {"chosen": explanation.chosen_config, **({"fp8": fp8_notes(plan)} if plan.precision == "fp8" else {}),
            "alternatives": [{"label": a.label, "config": a.config, "changes": list(a.changes),
                              "step_time_s": a.step_time_s, "peak_memory_bytes": a.peak_memory_bytes}
                             for a in explanation.alternatives],
            "rows": [{"term": row.term, "unit": row.unit, "chosen": row.chosen, "deltas": list(row.deltas)}
                     for row in explanation.rows]}

"""The readable report of a Plan (`autopar plan`, `Plan.summary()`).

`Plan.summary()` is public, so the plan module calls this one; the report reads a plan's fields
and imports nothing of plan.py back (not even for types), so the two make no import cycle."""

from __future__ import annotations

import re

from autopar.validation import human_bytes


_BLOCK_INDEX = re.compile(r"\.(\d+)(?=\.)")
_ROLE_WORDS = {"col": "column-parallel", "row": "row-parallel", "vocab": "vocab-parallel",
               "hidden": "hidden-parallel", "replicate": "replicated", "batch": "batch/heads split",
               "partial": "on partial sums", "channels": "channel split"}


def plan_summary(plan, *, max_stages: int = 8, max_params: int = 14) -> str:
    predicted = plan.predicted
    lines = [
        f"autopar plan for {plan.model or 'model'} on {plan.cluster} ({plan.num_devices} devices), "
        f"global batch {plan.global_batch}",
        _mesh_line(plan) + _experts(plan),
        f"  microbatches  {plan.num_microbatches} of {plan.microbatch_size}, schedule {_schedule(plan)}"
        + _split(plan),
        f"  memory saving recompute={plan.recompute}{_lighter_stages(plan)}, ZeRO stage {plan.zero_stage}"
        + (", optimizer offload to host memory (FSDP2 CPUOffloadPolicy)" if plan.offload else "")
        + (", first and last segments in FSDP's root unit" if getattr(plan, "fsdp_root_ends", False) else ""),
        *([f"  fp8           {len(plan.fp8_linears)} linears in float8 (torchao, {plan.fp8_recipe} scaling), "
           f"casts {plan.fp8_casts or 'eager'}" + _fp8_experts(plan) + ", the rest in bf16"]
          if plan.precision == "fp8" else []),
        *(["  tp overlap    async: sequence-parallel all-gathers and reduce-scatters fused with their GEMMs "
           "(torch's async TP)"] if getattr(plan, "tp_overlap", "off") == "async" else []),
        f"  predicted     {predicted.step_time_s:.4g} s per step, {plan.model_tflops_per_device:.1f} model "
        f"TFLOP/s per device, " + (f"{predicted.tokens_per_s:,.0f} tokens/s" if predicted.tokens_per_s
                                    else f"{plan.global_batch / max(predicted.step_time_s, 1e-12):,.0f} samples/s")
        + _error_bar(plan),
        "  step time breakdown:",
    ]
    total = predicted.step_time_s or 1.0
    for name, seconds in sorted(predicted.breakdown_s.items(), key=lambda item: -item[1]):
        if seconds > 0 or (seconds < 0 and name in _CALIBRATED_TERMS):  # a multiplier below 1 subtracts
            lines.append(f"    {name:<26} {seconds:10.4g} s  {100 * seconds / total:5.1f}%")
    lines.append(f"  memory per device (peak stage): {human_bytes(predicted.peak_memory_bytes)} of "
                 f"{human_bytes(predicted.memory_budget_bytes)} usable")
    for name, size in predicted.memory_bytes.items():
        if size > 0:
            lines.append(f"    {name:<20} {human_bytes(size):>12}")
    if predicted.host_memory_bytes:
        lines.append(f"  host memory per device (offloaded states): "
                     f"{human_bytes(sum(predicted.host_memory_bytes.values()))}")
        lines += [f"    {name:<20} {human_bytes(size):>12}" for name, size in predicted.host_memory_bytes.items() if size]
    lines += _stages(plan, max_stages)
    lines += _tensor_parallel(plan, max_params)
    if plan.replicated_ops:
        ops = ", ".join(f"{name} x{count}" for name, count in plan.replicated_ops[:8])
        lines.append(f"  replicated (no sharding rule): {ops}")
    lines += _runners_up(plan)
    lines += trials_table(plan)
    for note in plan.notes[:6]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


_CALIBRATED_TERMS = ("compute.in_step", "comm.pattern")


def _mesh_line(plan) -> str:
    mesh = plan.mesh
    if mesh.get("cp", 1) == 1:
        return f"  mesh          pp={mesh['pp']} x dp={mesh['dp']} x tp={mesh['tp']} (tp inside a node, then dp, then pp)"
    return (f"  mesh          pp={mesh['pp']} x dp={mesh['dp']} x cp={mesh['cp']} x tp={mesh['tp']} (tp inside a node, "
            f"then cp, dp, pp; each sequence split over the {mesh['cp']} cp ranks, gradients reduced over dp x cp)")


def _error_bar(plan) -> str:
    error = plan.predicted.expected_error
    if error:
        return f" (calibrated; expected error +-{100 * error:.0f}%)"
    if getattr(plan, "calibration", "") == "uncalibrated":
        return " (UNCALIBRATED profile: error unknown, see notes)"
    return ""


def trials_table(plan) -> list[str]:
    """Per candidate of the trials: predicted and measured step time side by side."""
    if not plan.trials:
        return []
    lines = ["  trials (measured on this job, slowest rank, median after warm-up):",
             f"    {'candidate':<66} {'predicted':>10} {'measured':>10} {'error':>7}"]
    for row in plan.trials:
        measured = row.get("measured_s")
        error = row.get("error")
        mark = "  <- chosen" if row.get("chosen") else ""
        shown = f"{measured * 1e3:8.1f}ms" if measured else "  failed  "
        extra = " (stopped early)" if row.get("stopped_early") else (f" ({row['failure']})" if row.get("failure") else "")
        lines.append(f"    {row['config']:<66} {row['predicted_s'] * 1e3:8.1f}ms {shown} "
                     f"{'' if error is None else f'{100 * error:+6.0f}%'}{mark}{extra}")
    return lines


def _own_recompute(plan, stage) -> str:
    """The stage's recomputation where it differs from the plan's, else ""."""
    return stage.recompute if stage.recompute not in ("", plan.recompute) else ""


def _lighter_stages(plan) -> str:
    lighter = [stage.index for stage in plan.stages if _own_recompute(plan, stage)]
    return f" (stages {', '.join(map(str, lighter))} need less)" if lighter else ""


def _split(plan) -> str:
    """How the pipeline chunks were cut, where it is not autopar's balanced cut."""
    split = getattr(plan, "pipeline_split", "balanced")
    return f", stages cut by count ({split})" if plan.mesh["pp"] > 1 and split != "balanced" else ""


def _schedule(plan) -> str:
    if plan.mesh["pp"] == 1:
        return "none (no pipeline; gradients accumulate over microbatches)"
    if plan.schedule == "interleaved":
        return f"interleaved 1F1B with {plan.virtual_stages} model chunks per device"
    if plan.schedule == "zb1p":
        chunks = f" with {plan.virtual_stages} model chunks per device" if plan.virtual_stages > 1 else " (ZB-H1)"
        return f"zero-bubble ZB-1P{chunks}, weight gradients deferred into the bubble"
    if plan.schedule == "zbv":
        return "zero-bubble ZB-V: 2 model chunks per device in a V, weight gradients deferred into the bubble"
    return plan.schedule.upper() if plan.schedule == "gpipe" else "1F1B"


def _stages(plan, max_stages: int) -> list[str]:
    if len(plan.stages) <= 1:
        return []
    lines = ["  pipeline stages:"]
    for stage in plan.stages[:max_stages]:
        chunks = stage.chunks or (stage.segments,)
        parts = [_chunk_text(chunk) for chunk in chunks]
        memory = sum(stage.memory_bytes.values())
        recompute = f", recompute {own}" if (own := _own_recompute(plan, stage)) else ""
        lines.append(f"    stage {stage.index}: {'; '.join(parts)}, "
                     f"{stage.time_per_microbatch_s * 1e3:.3g} ms per microbatch, {human_bytes(memory)}{recompute}")
    if len(plan.stages) > max_stages:
        lines.append(f"    ... {len(plan.stages) - max_stages} more")
    return lines


def _chunk_text(segments) -> str:
    """"prologue + layers 0-11" for a chunk's segments."""
    blocks = [int(name.rsplit(".", 1)[1]) for name in segments if name.rsplit(".", 1)[-1].isdigit()]
    extra = [name for name in segments if name in ("prologue", "epilogue")]
    described = extra + ([f"layers {min(blocks)}-{max(blocks)}" if len(blocks) > 1 else f"layer {blocks[0]}"]
                         if blocks else [])
    return " + ".join(described) or ", ".join(segments)


def _fp8_experts(plan) -> str:
    """The expert grouped matmuls run in float8 (the notes say why any stay bf16)."""
    experts = getattr(plan, "fp8_experts", ())
    return f", {len(experts)} expert weights' grouped matmuls in float8 (torchao, rowwise)" if experts else ""


def _experts(plan) -> str:
    imbalance = "" if plan.moe_load_imbalance is None else (
        f"\n  moe routing   priced with load imbalance {plan.moe_load_imbalance:g} (the busiest expert rank's "
        "tokens over the even share, 1 = balanced; --moe-load-imbalance sets it)")
    if plan.ep <= 1:
        return imbalance
    cp = plan.mesh.get("cp", 1)
    replicas = f"dp/ep={plan.mesh['dp'] // plan.ep}" + (f" x cp={cp}" if cp > 1 else "")
    if plan.etp == 1 and plan.mesh["tp"] > 1:  # MoE parallel folding (solver/expert_folding.py)
        tp_dp = plan.mesh["tp"] * plan.mesh["dp"]
        held = "FSDP-sharded" if plan.zero_stage >= 1 else "their gradients reduced"
        return (f"\n  experts       etp=1: split over ep={plan.ep} of the tp x dp ranks, tp innermost, unsplit by "
                f"tp; each tp rank routes its own rows ({len(plan.ep_params)} expert weights, {held} over "
                f"tp x dp/ep={tp_dp // plan.ep})" + imbalance)
    held = f"FSDP-sharded and their gradients reduce-scattered over {replicas}" if plan.zero_stage >= 1 \
        else f"their gradients reduced over {replicas}"
    return (f"\n  experts       split over ep={plan.ep} of the dp ranks ({len(plan.ep_params)} expert weights, "
            f"tokens exchanged by all-to-all; {held})" + imbalance)


def _tensor_parallel(plan, max_params: int) -> list[str]:
    if plan.mesh["tp"] == 1:
        return []
    shown = [(name, placement) for name, placement in plan.param_placements.items()
             if all(index == "0" for index in _BLOCK_INDEX.findall(f".{name}.")) and not name.endswith("bias")]
    lines = [_sequence_parallel_line(plan),
             "  tensor parallel, weights of the first block (identical blocks share it; biases follow):"]
    for name, placement in shown[:max_params]:
        role = plan.param_roles.get(name, "")
        op, _, strategy = role.partition(" ")
        words = " ".join(_role_words(part) for part in strategy.split("+")) if strategy else ""
        lines.append(f"    {name:<40} {placement:<4} {op} {words}".rstrip())
    if plan.loss_parallel:
        lines.append(f"  loss          vocabulary-parallel cross-entropy: the logits stay sharded by class over "
                     f"tp={plan.mesh['tp']} (DTensor loss_parallel; three all-reduces of one value per token)")
    return lines


def _sequence_parallel_line(plan) -> str:
    tp = plan.mesh["tp"]
    if not plan.sequence_parallel:
        return (f"  sequence par. off: norms, dropouts and residual adds run replicated on the tp={tp} ranks, "
                "partial outputs are all-reduced (Megatron-LM without --sequence-parallel)")
    scatters = plan.predicted.collectives_per_microbatch.get("reduce_scatter", 0)
    if not scatters:
        return "  sequence par. allowed, not chosen: partial outputs are all-reduced"
    return (f"  sequence par. on: activations sequence-sharded across tp={tp} where cheaper ({scatters} "
            "reduce-scatters per microbatch in place of all-reduces; Korthikanti et al.)")


def _role_words(strategy: str) -> str:
    if strategy.startswith("dim") and strategy[3:].isdigit():
        return f"split on dim {strategy[3:]}"
    return _ROLE_WORDS.get(strategy, strategy)


def _runners_up(plan) -> list[str]:
    others = plan.search.get("runners_up") or []
    if not others:
        return []
    best = plan.predicted.step_time_s
    lines = [f"  alternatives considered ({plan.search.get('configs_priced', 0):,} priced in "
             f"{plan.search.get('search_time_s', 0):.1f} s):"]
    for other in others[:3]:
        slower = 100 * (other["step_time_s"] / best - 1) if best else 0.0
        lines.append(f"    {other['config']}: {other['step_time_s']:.4g} s (+{slower:.1f}%)")
    return lines

"""Assembles a Plan from the search's estimate and the intra-op solution."""

from __future__ import annotations

from autopar.graph import OpGraph
from autopar.plans.plan import SCHEMA_VERSION, Plan, Prediction, StagePlan
from autopar.solver.fp8 import Fp8Choice
from autopar.solver.experts import expert_param_names, find_expert_ops
from autopar.solver.search import SearchResult
from autopar.solver.sharding import ShardingResult
from autopar.solver.prepared import once_per_step
from autopar.solver.recompute_blocks import recomputed_names, segment_mode
from autopar.solver.step_model import ZERO_BUBBLE_SCHEDULES, Estimate, StageEstimate, recompute_comm_s, recompute_compute_s, weight_grad_s
from autopar.strategies.loss import VOCAB


def make_plan(graph: OpGraph, cluster, *, global_batch: int, estimate: Estimate, sharding: ShardingResult,
              memory_budget_bytes: float, search: SearchResult | None = None, notes: tuple[str, ...] = (),
              precision: str = "bf16", segments=None, strategies: dict | None = None,
              moe_load_imbalance: float | None = None, fp8: Fp8Choice | None = None, tp_overlap: str = "off") -> Plan:
    """`strategies` covers every node of `graph` (defaults to the sharding result's own);
    `moe_load_imbalance` is what its expert ops were priced with (None: the model has none); `fp8`
    is precision "fp8"'s choice (recorded as fp8_recipe, fp8_linears, fp8_experts and fp8_casts, its handling)."""
    strategies = strategies or sharding.strategies
    segments = segments or sharding.segments
    config = estimate.config
    model_flops = (graph.fwd_flops + graph.bwd_flops) * global_batch / graph.batch_size
    tokens = global_batch * _sequence_length(graph)
    prediction = Prediction(step_time_s=estimate.step_time_s, breakdown_s=dict(estimate.breakdown_s),
                            peak_memory_bytes=estimate.peak_memory_bytes, memory_bytes=dict(estimate.memory_bytes),
                            memory_budget_bytes=memory_budget_bytes, model_flops_per_step=model_flops,
                            tokens_per_s=tokens / estimate.step_time_s if estimate.step_time_s else 0.0,
                            fits=estimate.fits, host_memory_bytes=dict(estimate.host_memory_bytes),
                            collectives_per_microbatch=_collective_counts(segments, config.ep))
    return Plan(
        schema_version=SCHEMA_VERSION,
        model=graph.model_name,
        model_fingerprint=graph.fingerprint(),
        cluster=cluster.name,
        cluster_fingerprint=cluster.fingerprint(),
        num_devices=cluster.num_devices,
        global_batch=global_batch,
        mesh={"pp": config.pp, "dp": config.dp, "cp": config.cp, "tp": config.tp},
        microbatch_size=config.microbatch_size,
        num_microbatches=config.num_microbatches,
        schedule=config.schedule if config.pp > 1 else "none",
        virtual_stages=config.virtual_stages,
        recompute=config.recompute,
        zero_stage=config.zero_stage,
        offload=config.offload,
        fsdp_root_ends=any(stage.fsdp is not None and stage.fsdp.root_ends for stage in estimate.stages),
        sequence_parallel=config.sequence_parallel,
        pipeline_split=config.pipeline_split,
        loss_parallel=config.tp > 1 and any(strategies[node.name].name == VOCAB for node in graph.nodes
                                            if node.name in graph.loss_nodes and node.name in strategies),
        stages=tuple(_stage_plans(graph, estimate, segments)),
        placements=_placements(graph, strategies),
        param_placements={param.name: ",".join(strategies[param.node].output)
                          for param in graph.params if param.node in strategies},
        param_roles=_param_roles(graph, strategies),
        input_placements=tuple(",".join(strategies[node.name].output) for node in graph.nodes
                               if node.kind == "input" and node.name in strategies),
        precision=precision,
        fp8_recipe=fp8.recipe if fp8 is not None else "",
        fp8_linears=fp8.linears if fp8 is not None else (),
        fp8_experts=fp8.experts if fp8 is not None else (),
        fp8_casts=fp8.handling if fp8 is not None else "",
        tp_overlap=tp_overlap,
        predicted=prediction,
        replicated_ops=sharding.replicated_ops,
        search=_search_stats(estimate, sharding, search),
        notes=tuple(graph.notes) + tuple(estimate.notes) + tuple(notes),
        ep=config.ep,
        etp=1 if config.folds_experts else None,
        ep_params=expert_param_names(graph, find_expert_ops(graph)) if config.ep > 1 else (),
        moe_load_imbalance=moe_load_imbalance,
    )


def _param_roles(graph: OpGraph, strategies: dict) -> dict[str, str]:
    """The strategy of each parameter's first reader: "linear col", "embedding vocab"..."""
    roles = {}
    for param in graph.params:
        readers = [name for name in graph.consumers.get(param.node, ()) if graph[name].kind == "call"]
        if readers and readers[0] in strategies:
            op = graph[readers[0]].target.removeprefix("aten.").split(".")[0]
            roles[param.name] = f"{op} {strategies[readers[0]].name}"
    return roles


def _collective_counts(segments, ep: int = 1) -> dict[str, int]:
    """Tensor-parallel collectives, and with ep > 1 expert parallelism's all-to-alls (each expert
    op's dispatch and combine, forward and backward, a chain's first op dispatching and its last
    combining: ExpertExchange.messages)."""
    counts: dict[str, int] = {}
    for segment in segments:
        for event in segment.comm:
            counts[event.op] = counts.get(event.op, 0) + 1
        if ep > 1:
            for exchange in segment.expert_exchanges:
                counts["all_to_all"] = counts.get("all_to_all", 0) + len(exchange.messages())
    return counts


def _sequence_length(graph: OpGraph) -> int:
    """Tokens per sample: dim 1 of the first integer input (token ids); 0 without token ids."""
    for node in graph.nodes:
        if node.kind == "input" and node.outputs and node.output.dtype.startswith("int") and len(node.output.shape) > 1:
            return node.output.shape[1]
    return 0


def _stage_plans(graph: OpGraph, estimate: Estimate, segments) -> list[StagePlan]:
    block_index = {}
    for segment in graph.segments:
        if segment.block_group is not None:
            block_index[segment.name] = len(block_index)
    costs = {segment.name: segment for segment in segments}
    last_segment = graph.segments[-1].name if graph.segments else ""
    config = estimate.config
    recomputed = recomputed_names(graph.segments, mode=config.recompute, split=config.pipeline_split,
                                  num_chunks=config.num_chunks)
    stages = []
    for stage in estimate.stages:
        blocks = [block_index[name] for name in stage.segment_names if name in block_index]
        layers = (min(blocks), max(blocks) + 1) if blocks else (0, 0)
        stages.append(StagePlan(index=stage.index, segments=stage.segment_names, layers=layers, chunks=stage.chunks,
                                recompute=stage.recompute,
                                time_per_microbatch_s=stage.time_per_microbatch_s, param_numel=stage.param_numel,
                                memory_bytes=dict(stage.memory_bytes),
                                chunk_times_s=_chunk_times(stage, costs, last_segment, recomputed,
                                                           split=config.schedule in ZERO_BUBBLE_SCHEDULES),
                                collectives_per_microbatch=_collective_counts(
                                    [costs[name] for name in stage.segment_names if name in costs],
                                    estimate.config.ep)))
    return stages


_PHASES = {"fwd": "forward", "bwd": "backward", "grad": "backward"}


def _chunk_times(stage: StageEstimate, costs: dict, last_segment: str, recomputed: frozenset[str] = frozenset(), *,
                 split: bool = False) -> tuple[dict[str, float], ...]:
    """Per chunk, one microbatch's time by part, as the step model adds it up (timeline pictures
    lay blocks out from these): compute per phase, tensor-parallel collectives per phase (a full
    recompute replays the forward's), and the stage's pipeline sends split over the chunks that
    send (by bytes sent). `recomputed`: the segments "blocks:<N>" recomputes (recompute_blocks.py).
    `split`: the zero-bubble schedules' weight gradient is a part of its own ("weight"), out of
    "backward". Empty when the segment costs do not cover the stage."""
    chunks = stage.chunks or (stage.segment_names,)
    if not all(name in costs for chunk in chunks for name in chunk):
        return ()
    senders = {index: costs[chunk[-1]].output_bytes for index, chunk in enumerate(chunks) if chunk[-1] != last_segment}
    sent_bytes = sum(senders.values())
    times = []
    for index, chunk in enumerate(chunks):
        parts: dict[str, float] = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
        for segment in (costs[name] for name in chunk):
            parts["forward"] += segment.forward.total_s
            parts["backward"] += segment.backward.total_s
            if stage.fused_wgrad_numel:  # the configuration accumulates weight gradients in their GEMMs
                parts["backward"] -= segment.fused_wgrad_saving.total_s
            mode = segment_mode(stage.recompute, segment.name, recomputed)
            parts["recompute"] += recompute_compute_s(segment, mode)
            if split:
                weight = weight_grad_s(segment)
                parts["backward"] -= weight
                parts["weight"] = parts.get("weight", 0.0) + weight
            for event in segment.comm:
                if once_per_step(event):  # after the last microbatch, not in this one's time
                    continue
                phase = _PHASES.get(event.phase, "backward")
                name = event.op if event.op.startswith("cp.") else f"tp.{event.op}"  # cp's KV exchange
                _add(parts, f"{name}.{phase}", event.time_s)
            for op, seconds in recompute_comm_s(segment, mode).items():
                _add(parts, f"{op if op.startswith('cp.') else f'tp.{op}'}.recompute", seconds)
        for key, seconds in {**_fsdp_parts(stage), **_offload_parts(stage)}.items():
            _add(parts, key, seconds / len(chunks))
        in_chunk = set(chunk)
        for name, forward_s, backward_s in stage.ep_segment_s:
            if name in in_chunk:
                _add(parts, "ep.all_to_all.forward", forward_s)
                _add(parts, "ep.all_to_all.backward", backward_s)
        # The stage's sends, and all-gathers of what it receives as slices, less what runs beside
        # other chunks' compute (solver/p2p_overlap.py): over the chunks that send, by bytes; on
        # the first chunk of a stage that only receives.
        exposed_p2p = stage.p2p_s - stage.p2p_hidden_s
        if exposed_p2p and (index in senders or (not senders and index == 0)):
            share = exposed_p2p * ((senders[index] / sent_bytes if sent_bytes else 1 / len(senders)) if senders else 1.0)
            _add(parts, "pp.send_recv.forward", share / 2)
            _add(parts, "pp.send_recv.backward", share / 2)
        times.append(parts)
    return tuple(times)


def _fsdp_parts(stage: StageEstimate) -> dict[str, float]:
    """The stage's exposed FSDP2 collectives per microbatch, by pass: gathers waited for in the
    forward, the rest of the gathers (ZeRO-3 re-gathers) and the reduce-scatters in the backward."""
    exposed = getattr(stage, "fsdp_exposed_s", None) or {}
    if not exposed or stage.fsdp is None:
        return {}
    gather = exposed.get("all_gather", 0.0)
    forward = min(gather, stage.fsdp.forward_gather_exposed_s)
    return {"dp.all_gather.forward": forward, "dp.all_gather.backward": gather - forward,
            "dp.reduce_scatter.backward": exposed.get("reduce_scatter", 0.0)}


def _offload_parts(stage: StageEstimate) -> dict[str, float]:
    """Exposed optimizer-offload copies per microbatch: host-to-device ahead of the gathers (half
    in each pass under ZeRO-3), device-to-host and the host's accumulation after the backward."""
    terms = getattr(stage, "offload_s", None) or {}
    if not terms:
        return {}
    h2d = terms.get("offload.h2d", 0.0)
    return {"offload.h2d.forward": h2d / 2, "offload.h2d.backward": h2d / 2,
            "offload.d2h.backward": terms.get("offload.d2h", 0.0),
            "offload.grad_accumulate.backward": terms.get("offload.grad_accumulate", 0.0)}


def _add(parts: dict[str, float], key: str, seconds: float) -> None:
    parts[key] = parts.get(key, 0.0) + seconds


def _placements(graph: OpGraph, strategies: dict) -> dict[str, str]:
    placements = {}
    for node in graph.nodes:
        strategy = strategies.get(node.name)
        if strategy is None:
            continue
        output = ",".join(strategy.output)
        inputs = ";".join(",".join(p) for p in strategy.inputs)
        placements[node.name] = f"{output}|{inputs}" if inputs else output
    return placements


def _search_stats(estimate: Estimate, sharding: ShardingResult, search: SearchResult | None) -> dict:
    stats = {
        "sharding": {
            "variables": sharding.num_variables,
            "edges": sharding.num_edges,
            "status": sharding.solution.status,
            "gap": sharding.solution.gap,
            "build_time_s": sharding.build_time_s,
            "solve_time_s": sharding.solve_time_s,
        },
    }
    if search is not None:
        stats.update(configs_priced=search.num_configs, sharding_solves=search.num_sharding_solves,
                     search_time_s=search.search_time_s,
                     runners_up=[_runner_up(other) for other in search.ranked[1:]])
    return stats


def _runner_up(estimate: Estimate) -> dict:
    """An alternative the search ranked, with the terms `autopar explain` compares."""
    config = estimate.config
    return {"config": config.describe(), "step_time_s": estimate.step_time_s,
            "peak_memory_bytes": estimate.peak_memory_bytes,
            "breakdown_s": dict(estimate.breakdown_s), "memory_bytes": dict(estimate.memory_bytes),
            "settings": {"dp": config.dp, "tp": config.tp, "pp": config.pp, "cp": config.cp, "microbatch_size": config.microbatch_size,
                         "num_microbatches": config.num_microbatches, "schedule": config.schedule,
                         "virtual_stages": config.virtual_stages, "recompute": config.recompute,
                         "zero_stage": config.zero_stage, "ep": config.ep, "offload": config.offload,
                         "etp": 1 if config.folds_experts else None,
                         "sequence_parallel": config.sequence_parallel, "pipeline_split": config.pipeline_split},
            "stage_recompute": [stage.recompute for stage in estimate.stages]}

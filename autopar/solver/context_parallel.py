"""Context parallelism in the planner: segment costs of a microbatch whose sequences are split
over the `cp` axis of the mesh.

Every rank of a cp group holds `seq / cp` tokens of each sequence (2 cp chunks, rank i holding
chunks i and 2 cp - 1 - i: load-balanced causal attention) for the whole block, and the
parameters whole (their gradients are reduced over dp x cp, as torchtitan folds cp into FSDP's
mesh). So, from the tensor-parallel solution at the full sequence (sharding.py), per segment:

    compute, recompute          every op re-priced at 1 / cp of its FLOPs and of its activations'
                                (not its weights') bytes: per-token work, and load-balanced causal
                                attention too (cost_model/context_parallel.py); smaller matmuls
                                run at a lower efficiency, launches cost the same
    tp collectives (fwd, bwd)   message / cp, re-priced on the tp group (latency is kept)
    activations, pipeline sends x 1 / cp
    parameters, buffers, their gradients' collectives: unchanged
    + per attention op: the KV exchange over the cp group, exposed beyond the attention compute
      it overlaps ("cp.kv_all_gather" forward, "cp.kv_reduce_scatter" backward, or the ring's
      "cp.kv_ring" steps), and for the all-gather the gathered K, V kept for the backward;
      recomputing the attention (full or selective recomputation) exchanges K, V again.
    torch's `context_parallel` as it runs (methods "torch", "torch_compiled":
    cost_model/context_parallel.py) instead prices in the compute its SDPA calls step by step
    (the causal diagonal and cp - 1 non-causal blocks at their own rates, in place of the even
    split's causal price) and its fp32 merges and accumulations, and as collectives the K, V at
    every query head gathered in the forward and again in the backward ("cp.kv_all_gather") and
    the fp32 dK, dV sent after every backward step ("cp.dkv_ring"), exposed as the runtime waits
    on them; nothing gathered is kept for the backward.

The transformation assumes every op but attention works token by token; the planner only
offers cp > 1 when `strategies.attention.context_parallel_blocker` finds nothing else mixing
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.graph import OpGraph
from autopar.mesh import Mesh
from autopar.solver.costing import CommEvent, CostContext
from autopar.solver.evaluate import SegmentCost, is_recomputable
from autopar.solver.experts import GroupedMatmul
from autopar.strategies.attention import attention_nodes, is_causal, kv_repeats
from autopar.strategies.placement import shard_factor, shards_on_dim
from cost_model.comm import CommModel, Group
from cost_model.compute import ComputeModel, ComputeTime
from cost_model.context_parallel import (TORCH_BACKWARD_BYTES_PER_ELEMENT, TORCH_MERGE_BYTES_PER_ELEMENT,
                                          TORCH_METHODS, causal_work_share, exposed_kv_exchange_s, ring_step_bytes,
                                          torch_dkv_sends_exposed_s, torch_gather_exposed_s, torch_ring_steps)

KV_ALL_GATHER = "cp.kv_all_gather"
KV_REDUCE_SCATTER = "cp.kv_reduce_scatter"
KV_RING = "cp.kv_ring"
DKV_RING = "cp.dkv_ring"


@dataclass(frozen=True, kw_only=True)
class TorchRing:
    """One attention op run by torch's `context_parallel` on one rank (per microbatch)."""

    forward_delta: ComputeTime
    """Its SDPA calls (the diagonal, cp - 1 non-causal blocks) less the even split's causal price."""
    backward_delta: ComputeTime
    diagonal_forward_s: float
    diagonal_backward_s: float
    step_backward_s: float
    """One non-causal block's backward: what a dK, dV send overlaps when eager."""
    merge_forward: ComputeTime
    """The fp32 merges of the forward's cp - 1 steps."""
    merge_backward: ComputeTime
    """The fp32 accumulations of the backward's cp steps."""


@dataclass(frozen=True, kw_only=True)
class AttentionCost:
    """One attention op of a segment, on one tensor-parallel rank, at the full sequence."""

    node: str
    kv_bytes: float
    """Bytes of K plus V on this tp rank (what one rank gathers from the whole cp group): of the
    kv heads only, when K and V are kv heads repeated for every query head (kv_repeats)."""
    forward: ComputeTime
    backward: ComputeTime
    causal: bool
    sdpa_kv_bytes: float = 0.0
    """Bytes of K plus V on this tp rank at every query head: what torch's `context_parallel` moves
    for a model that repeats its kv heads before SDPA, as torchtitan's Llama does (`repeat_kv`;
    torch's flash and efficient kernels of 2024 took as many K, V heads as query heads)."""
    torch_ring: TorchRing | None = None
    """How torch's `context_parallel` runs it (methods "torch", "torch_compiled"; else None)."""


def sequence_length(graph: OpGraph) -> int:
    """Tokens per sample: dim 1 of the first integer input of rank >= 2 (token ids); 0 without."""
    for node in graph.nodes:
        if node.kind == "input" and node.outputs and node.output.dtype.startswith("int") and len(node.output.shape) > 1:
            return node.output.shape[1]
    return 0


def attention_costs(graph: OpGraph, strategies: dict, ctx: CostContext, *, cp: int = 1,
                    method: str = "all_gather") -> dict[str, list[AttentionCost]]:
    """Per segment name, its attention ops priced under their tensor-parallel strategies (and, for
    torch's methods, as torch's ring runs them over `cp` ranks)."""
    segment_of = {name: segment.name for segment in graph.segments for name in segment.nodes}
    found: dict[str, list[AttentionCost]] = {}
    for node in attention_nodes(graph):
        strategy = strategies.get(node.name)
        if strategy is None or node.name not in segment_of:
            continue
        inputs = [graph[source].output for source in node.inputs]
        forward, backward = ctx.node_compute(node, strategy, inputs)
        kv_bytes = sum(inputs[index].nbytes / shard_factor(strategy.inputs[index], ctx.mesh.shape) for index in (1, 2))
        # K, V at every query head: repeated in the graph, or for the kernel where sdpa takes fewer (enable_gqa)
        sdpa_kv_bytes = kv_bytes * max(1, inputs[0].shape[1] // inputs[1].shape[1]) if len(inputs[1].shape) == 4 \
            else kv_bytes
        kv_bytes /= local_kv_repeats(node, inputs, strategy, kv_repeats(graph, node), ctx.mesh.shape)
        ring = torch_ring(node, inputs, strategy, ctx, cp, method) if method in TORCH_METHODS and cp > 1 else None
        found.setdefault(segment_of[node.name], []).append(
            AttentionCost(node=node.name, kv_bytes=kv_bytes, forward=forward, backward=backward, causal=is_causal(node),
                          sdpa_kv_bytes=sdpa_kv_bytes, torch_ring=ring))
    return found


def torch_ring(node, inputs, strategy, ctx: CostContext, cp: int, method: str) -> TorchRing:
    """`node` as torch's `context_parallel` runs it on one rank (cost_model/context_parallel.py)."""
    divisor = strategy.work_divisor(ctx.mesh.shape)
    causal = is_causal(node)
    bytes_scale = 1.0 / (cp * divisor)
    even = [ctx.compute.kernels(kernels, flops_scale=1.0 / (divisor * cp), bytes_scale=bytes_scale, causal=causal)
            for kernels in (node.fwd_kernels, node.bwd_kernels)]
    steps = torch_ring_steps(cp, causal=causal)
    forward, backward = [[ctx.compute.kernels(kernels, flops_scale=step.flops_fraction / divisor,
                                              bytes_scale=bytes_scale, causal=step.causal)
                          for step in steps] for kernels in (node.fwd_kernels, node.bwd_kernels)]
    q_elements = inputs[0].numel / shard_factor(strategy.inputs[0], ctx.mesh.shape) / cp
    kv_elements = 2 * q_elements  # K and V at every query head (AttentionCost.sdpa_kv_bytes)
    bandwidth = ctx.compute.bandwidth_bytes_per_s
    q_bytes, kv_bytes = TORCH_BACKWARD_BYTES_PER_ELEMENT[method]
    merge_forward = ComputeTime(memory_s=(cp - 1) * TORCH_MERGE_BYTES_PER_ELEMENT[method] * q_elements / bandwidth,
                                overhead_s=(cp - 1) * ctx.compute.overhead_s)
    merge_backward = ComputeTime(memory_s=cp * (q_bytes * q_elements + kv_bytes * kv_elements) / bandwidth,
                                 overhead_s=cp * ctx.compute.overhead_s)
    return TorchRing(forward_delta=_minus(sum(forward, ComputeTime()), even[0]),
                     backward_delta=_minus(sum(backward, ComputeTime()), even[1]),
                     diagonal_forward_s=forward[0].total_s, diagonal_backward_s=backward[0].total_s,
                     step_backward_s=backward[-1].total_s, merge_forward=merge_forward, merge_backward=merge_backward)


def local_kv_repeats(node, inputs, strategy, repeats: int, mesh_shape) -> int:
    """`repeats` when each tp rank's heads of K hold whole groups of copies (the runtime then
    gathers every `repeats`-th head), else 1; codegen/context_parallel.py makes the same test."""
    if repeats <= 1 or len(inputs[1].shape) != 4:
        return 1
    local_heads = inputs[1].shape[1] // shards_on_dim(strategy.inputs[1], 1, mesh_shape)
    return repeats if local_heads % repeats == 0 else 1


@dataclass(frozen=True, kw_only=True)
class SplitCompute:
    """A segment's compute re-priced at 1 / cp of the tokens."""

    forward: ComputeTime
    backward: ComputeTime
    selective_recompute: ComputeTime


def split_compute(graph: OpGraph, strategies: dict, ctx: CostContext, cp: int) -> dict[str, SplitCompute]:
    """Per segment, its ops priced as evaluate.py prices them, on 1 / cp of the tokens."""
    segment_of = {name: segment.name for segment in graph.segments for name in segment.nodes}
    totals: dict[str, list[ComputeTime]] = {}
    for node in graph.calls():
        strategy, segment = strategies.get(node.name), segment_of.get(node.name)
        if strategy is None or segment is None:
            continue
        inputs = [graph[source].output for source in node.inputs]
        is_weight = [graph[source].kind in ("param", "buffer", "constant") for source in node.inputs]
        full_bytes = sum(meta.nbytes for meta in inputs) + sum(meta.nbytes for meta in node.outputs)
        local_bytes = sum(meta.nbytes / shard_factor(placements, ctx.mesh.shape) / (1 if weight else cp)
                          for meta, placements, weight in zip(inputs, strategy.inputs, is_weight))
        local_bytes += sum(meta.nbytes / shard_factor(strategy.output, ctx.mesh.shape) / cp for meta in node.outputs)
        divisor = strategy.work_divisor(ctx.mesh.shape) * cp
        bytes_scale = local_bytes / full_bytes if full_bytes else 1.0 / divisor
        groups = ctx.local_experts(node, strategy, inputs)  # a grouped expert matmul's experts
        forward = ctx.compute.kernels(node.fwd_kernels, flops_scale=1.0 / divisor, bytes_scale=bytes_scale,
                                      groups=groups)
        backward = ctx.compute.kernels(node.bwd_kernels, flops_scale=1.0 / divisor, bytes_scale=bytes_scale,
                                       groups=groups)
        parts = totals.setdefault(segment, [ComputeTime(), ComputeTime(), ComputeTime()])
        parts[0], parts[1] = parts[0] + forward, parts[1] + backward
        if is_recomputable(graph, node):
            parts[2] = parts[2] + forward
    return {name: SplitCompute(forward=f, backward=b, selective_recompute=r) for name, (f, b, r) in totals.items()}


def cp_group(cp: int, tp: int, devices_per_node: int) -> Group:
    """The cp axis of a (pp, dp, cp, tp) mesh: cp ranks tp apart."""
    return Mesh(axis_names=("cp", "tp"), shape=(cp, tp), devices_per_node=devices_per_node).group(0)


def split_sequence(segment: SegmentCost, attentions: list[AttentionCost], *, cp: int, tp: int, comm: CommModel,
                   devices_per_node: int, method: str = "all_gather", load_balanced: bool = True,
                   compute: SplitCompute | None = None, compute_model: ComputeModel | None = None) -> SegmentCost:
    """`segment`'s cost per rank when each sequence is split over `cp` ranks (module docstring);
    `compute` is its re-priced compute (split_compute), else its compute is scaled by 1 / cp;
    `compute_model` re-prices its expert ops' grouped matmuls on 1 / cp of the rows."""
    if cp <= 1:
        return segment
    scale = 1.0 / cp
    tp_group = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=devices_per_node).group(0)
    events = [_rescaled(event, scale, comm, tp_group) for event in segment.comm]
    cast = segment.cast  # the weight gradients' cast (backward) does not shrink with the tokens
    compute = compute or SplitCompute(forward=_per_token(segment.forward, scale),
                                      backward=_per_token(_minus(segment.backward, cast), scale),
                                      selective_recompute=_per_token(segment.selective_recompute, scale))
    forward, backward = compute.forward, compute.backward + cast
    saved = segment.saved_bytes * scale
    group = cp_group(cp, tp, devices_per_node)
    recompute_comm = [_rescaled(event, scale, comm, tp_group) for event in segment.selective_recompute_comm]
    for attention in attentions:
        if method in TORCH_METHODS:
            ring = attention.torch_ring
            forward = forward + ring.forward_delta + ring.merge_forward
            backward = backward + ring.backward_delta + ring.merge_backward
            exchange = _torch_exchange(attention, cp, comm, group, method)
            events += exchange
            recompute_comm += [event for event in exchange if event.phase == "fwd"]  # sdpa is recomputed
            continue  # the gathered K, V are not kept: the backward gathers them again
        share = causal_work_share(cp, load_balanced=load_balanced) if attention.causal else scale
        # Compute above is already the even share; an unbalanced causal split costs the busiest rank more.
        forward = forward + attention.forward.scaled(share - scale)
        backward = backward + attention.backward.scaled(share - scale)
        exchange = _kv_exchange(attention, share, cp, comm, group, method)
        events += exchange
        recompute_comm += [event for event in exchange if event.phase == "fwd"]  # sdpa is recomputed
        if method == "all_gather":
            saved += attention.kv_bytes * (1 - scale)  # the gathered K, V, kept for the backward
    return replace(segment, forward=forward, backward=backward, comm=events, saved_bytes=saved,
                   selective_kept={key: size * scale for key, size in segment.selective_kept.items()},
                   selective_recompute=compute.selective_recompute,
                   selective_recompute_comm=recompute_comm,
                   output_bytes=segment.output_bytes * scale, input_bytes=segment.input_bytes * scale,
                   # the recomputation modes' per-token figures (evaluate.py), on 1 / cp of the tokens
                   op_kept={key: size * scale for key, size in segment.op_kept.items()},
                   op_recompute=_per_token(segment.op_recompute, scale),
                   node_kept_bytes={name: size * scale for name, size in segment.node_kept_bytes.items()},
                   saved_by_root={name: size * scale for name, size in segment.saved_by_root.items()},
                   node_forward={name: _per_token(time, scale) for name, time in segment.node_forward.items()},
                   node_comm={name: [_rescaled(event, scale, comm, tp_group) for event in events]
                              for name, events in segment.node_comm.items()},
                   activation_recompute=_per_token(segment.activation_recompute, scale),
                   gathered={key: (saved_bytes * scale, shard_bytes * scale, seconds * scale, dedup)
                             for key, (saved_bytes, shard_bytes, seconds, dedup) in segment.gathered.items()},
                   grad_workspace_bytes=segment.grad_workspace_bytes * scale,
                   # expert parallelism exchanges this rank's tokens, 1 / cp of them (within the
                   # ep group of its cp index: codegen/runtime.expert_device_mesh)
                   expert_exchanges=[replace(exchange, token_bytes=exchange.token_bytes * scale,
                                             output_bytes=exchange.output_bytes * scale,
                                             compute_s=exchange.compute_s * scale,
                                             matmuls=tuple(_split_matmul(matmul, scale, compute_model)
                                                           for matmul in exchange.matmuls))
                                     for exchange in segment.expert_exchanges],
                   expert_region_comm=[_rescaled(event, scale, comm, tp_group) for event in segment.expert_region_comm])


def _split_matmul(matmul: GroupedMatmul, scale: float, compute_model: ComputeModel | None) -> GroupedMatmul:
    """A grouped matmul on `scale` of its rows: its FLOPs and row bytes scale, its experts' weights
    do not; its time without ep re-priced on that shape (as split_compute prices the op)."""
    if compute_model is None:
        raise ValueError("split_sequence needs compute_model to re-price expert grouped matmuls")
    split = replace(matmul, flops=matmul.flops * scale,
                    io_bytes=(matmul.io_bytes - matmul.expert_bytes) * scale + matmul.expert_bytes)
    return replace(split, alone_s=split.time_s(compute_model))


def _minus(time: ComputeTime, part: ComputeTime) -> ComputeTime:
    return ComputeTime(matmul_s=time.matmul_s - part.matmul_s, memory_s=time.memory_s - part.memory_s,
                       overhead_s=time.overhead_s - part.overhead_s)


def _per_token(time: ComputeTime, scale: float) -> ComputeTime:
    """Kernel time of a `scale` share of the tokens: the same kernels launch, on less data."""
    return ComputeTime(matmul_s=time.matmul_s * scale, memory_s=time.memory_s * scale, overhead_s=time.overhead_s)


def _rescaled(event: CommEvent, scale: float, comm: CommModel, group: Group) -> CommEvent:
    """An activation's tp collective on a 1 / cp share of the tokens (weights' gradients: kept), its
    copies and the GEMMs beside it (tp_windows.py) on that share too."""
    if event.phase not in ("fwd", "bwd") or not event.message_bytes:
        return event
    message = event.message_bytes * scale
    copy_s = event.copy_s * scale
    window = None if event.window is None else tuple((node, seconds * scale) for node, seconds in event.window)
    return replace(event, message_bytes=message, time_s=comm.time_s(event.op, message, group) + copy_s, copy_s=copy_s,
                   window=window, fused_pass_s=event.fused_pass_s * scale,
                   unfused_copy_s=None if event.unfused_copy_s is None else event.unfused_copy_s * scale)


def _kv_exchange(attention: AttentionCost, share: float, cp: int, comm: CommModel, group: Group,
                 method: str) -> list[CommEvent]:
    """The exposed KV traffic of one attention op (events carry exposed seconds; axis -1: cp)."""
    forward_s, backward_s = attention.forward.total_s * share, attention.backward.total_s * share
    if method == "ring":
        events = []
        for phase, attention_s, backward in (("fwd", forward_s, False), ("bwd", backward_s, True)):
            step_bytes = ring_step_bytes(attention.kv_bytes, cp, backward=backward)
            step_s = comm.time_s("send_recv", step_bytes, group)
            events.append(CommEvent(op=KV_RING, axis=-1, message_bytes=step_bytes * (cp - 1), phase=phase,
                                    time_s=exposed_kv_exchange_s(method="ring", collective_s=step_s,
                                                                 attention_s=attention_s, num_ranks=cp)))
        return events
    gather_s = comm.time_s("all_gather", attention.kv_bytes, group)
    scatter_s = comm.time_s("reduce_scatter", attention.kv_bytes, group)
    return [CommEvent(op=KV_ALL_GATHER, axis=-1, message_bytes=attention.kv_bytes, phase="fwd",
                      time_s=exposed_kv_exchange_s(method=method, collective_s=gather_s, attention_s=forward_s,
                                                   num_ranks=cp)),
            CommEvent(op=KV_REDUCE_SCATTER, axis=-1, message_bytes=attention.kv_bytes, phase="bwd",
                      time_s=exposed_kv_exchange_s(method=method, collective_s=scatter_s, attention_s=backward_s,
                                                   num_ranks=cp))]


def _torch_exchange(attention: AttentionCost, cp: int, comm: CommModel, group: Group, method: str) -> list[CommEvent]:
    """torch's `context_parallel` exchange of one attention op, exposed as it waits (events carry
    exposed seconds; axis -1: cp): the K, V all-gather forward and backward, the fp32 dK, dV sends."""
    ring = attention.torch_ring
    gather_s = comm.time_s("all_gather", attention.sdpa_kv_bytes, group)
    send_bytes = 2 * attention.sdpa_kv_bytes / cp  # fp32 dK, dV: twice the bf16 K, V
    send_s = comm.time_s("send_recv", send_bytes, group)
    forward_s = torch_gather_exposed_s(method=method, gather_s=gather_s, diagonal_s=ring.diagonal_forward_s)
    gather_back_s = torch_gather_exposed_s(method=method, gather_s=gather_s, diagonal_s=ring.diagonal_backward_s)
    sends_s = torch_dkv_sends_exposed_s(method=method, send_s=send_s, step_s=ring.step_backward_s, num_ranks=cp)
    return [CommEvent(op=KV_ALL_GATHER, axis=-1, message_bytes=attention.sdpa_kv_bytes, phase="fwd", time_s=forward_s),
            CommEvent(op=KV_ALL_GATHER, axis=-1, message_bytes=attention.sdpa_kv_bytes, phase="bwd",
                      time_s=gather_back_s),
            CommEvent(op=DKV_RING, axis=-1, message_bytes=send_bytes * cp, phase="bwd", time_s=sends_s)]

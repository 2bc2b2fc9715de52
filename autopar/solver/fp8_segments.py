"""Precision "fp8": the float8 linears' matmuls in the compute of the prepared segments.

Float8 matmuls shorten the compute that hides collectives (FSDP's and ZeRO's gathers and
reduce-scatters, tensor-parallel overlap, pipeline sends), that the pipeline's stages are cut on
and that its bubble is made of. So an fp8 configuration is priced on segments whose compute
already holds the kept linears' float8 matmuls in place of their bf16 ones (`float8_segments`);
Fp8Pricing.apply then names that time (`fp8.matmul`) and adds what is not matmul time: casts,
amax reductions, float8 gathers, the expert grouped matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autopar.graph import OpGraph
from autopar.solver.configs import ParallelConfig
from autopar.solver.fp8_pricing import Fp8Pricing
from autopar.solver.prepared import PreparedSegments


def float8_segments(pricing: Fp8Pricing, graph: OpGraph, prepared: PreparedSegments, config: ParallelConfig,
                    strategies: Callable[[ParallelConfig], dict]) -> PreparedSegments:
    """`prepared` (priced in bf16 for `config`) with each kept float8 linear's matmuls at their
    float8 time (Fp8Pricing.priced: per microbatch on one rank), in the segment that holds the
    linear: its forward matmul in the forward (and, under full recomputation, in the recomputed
    forward), its gradient matmuls in the backward (the weight's also in the weight-gradient
    time), and the collectives beside them hidden by their float8 GEMMs (PreparedSegments.
    overlap_caps_s). Unchanged where the device emulates float8."""
    kept = [item for item in pricing.priced(config, strategies) if item.kept and any(item.matmuls.change_s.values())]
    if not kept:
        return prepared
    segment_of = {node: segment.name for segment in graph.segments for node in segment.nodes}
    row = {name: index for index, name in enumerate(prepared.names)}
    changes = {role: np.zeros(len(prepared.names)) for role in ("output", "grad_input", "grad_weight")}
    for item in kept:
        index = row.get(segment_of.get(item.linear.node, ""))
        if index is None:
            continue
        for role, seconds in item.matmuls.change_s.items():
            changes[role][index] += seconds
    again = changes["output"] if config.recompute == "full" else np.zeros(len(prepared.names))
    speedups = {item.linear.node: item.matmuls.bf16["output"] / item.matmuls.fp8["output"]
                for item in kept if item.matmuls.fp8["output"] > 0}
    return prepared.with_compute_change(changes["output"], changes["grad_input"] + changes["grad_weight"], again,
                                        changes["grad_weight"], gemm_speedups=speedups)

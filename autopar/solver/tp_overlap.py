"""Tensor-parallel communication overlapped with the GEMMs it feeds, for runtimes that run it so
(PrecisionPolicy.tp_comm_overlap: Megatron-Core / NeMo with `tp_comm_overlap`, Transformer
Engine's userbuffers).

With sequence parallelism each transformer layer all-gathers its sequence-sharded input before
the column-parallel GEMMs (QKV, FC1) and reduce-scatters the row-parallel GEMMs' outputs (proj,
FC2); the backward mirrors them. Transformer Engine's TP overlap decomposes each collective
into its tp ring steps and runs every step beside one chunk of the GEMM: the all-gather as a
ring exchange (chunk i of the GEMM computes on the shard received in step i while step i + 1
transfers), the reduce-scatter pipelined behind the GEMM's chunks (chunk i's partial sums are
sent while chunk i + 1 computes), and in the backward the input's all-gather and the input
gradient's reduce-scatter "bulk"-overlapped with the dgrad and wgrad GEMMs (Wang et al.,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models", ASPLOS 2023; NVIDIA Transformer Engine, `initialize_ub`, and NeMo's
`tp_comm_overlap`). Of the tp ring steps, one has no GEMM chunk beside it (the ring exchange's
last transfer, the pipelined reduce-scatter's last chunk), and each step hides behind its own
GEMM's chunk only (solver/tp_windows.py: a collective beside a short GEMM, the q, k and v of a
grouped-query attention or any float8 GEMM, stays partly exposed), so per collective

    hidden = min(time, its GEMM's time) x (tp - 1) / tp   (in all, at most the stage's compute)

and the hidden seconds hold SMs while the GEMMs run (cost_model/contention.py): they add
hidden x channels / SMs. torch's symmetric-memory kernels add a memory pass each (the shard's copy
into the symmetric buffer, the sum of the tp partial outputs: PrecisionPolicy.tp_overlap_passes,
priced in the layout-copy terms by tp_windows.with_windows); a collective left unfused keeps DTensor's
layout copy.

What each runtime fuses. Transformer Engine overlaps every one of them: Megatron-Core runs the
readers of one gathered input as one linear (linear_qkv; linear_fc1 holds gate and up), so each
backward reduce-scatter follows one dgrad GEMM. torch's async TP (the inductor pass
micro_pipeline_tp, torchtitan's enable_async_tensor_parallel) fuses an all-gather with every matmul
reading it, but a reduce-scatter only with the single matmul producing it; where q, k and v (or
gate and up) are separate linears, the gradient of their shared input is a sum of their dgrads, and
its reduce-scatter runs after the sum, exposed ("reduce_scatter.summed", PrecisionPolicy.
tp_overlap_sums False). autopar's runtime does the same (codegen/async_tp.py). Collectives without sequence parallelism (all-reduces), the context-
parallel exchange and the expert all-to-alls are not overlapped this way and stay as priced.
autopar's own runtime runs the same overlap as torch's async TP where the plan's tp_overlap is
"async" (codegen/async_tp.py: the default on CUDA clusters) and is priced so; with "off" it issues
its tensor-parallel collectives through DTensor, exposed (tp_comm_overlap False).

Without TP overlap, Megatron-LM and Transformer Engine still run one collective beside a GEMM: a
sequence-parallel linear keeps its input's shard and all-gathers it again in backward before the
input-gradient GEMM, waiting after it (PrecisionPolicy.regather_overlap; `overlap_regather`).
"""

from __future__ import annotations

OVERLAPPED_OPS = ("all_gather", "reduce_scatter")
"""The sequence-parallel collectives TP overlap decomposes (with their recompute variants,
"all_gather.regather")."""


def overlappable(op: str, sums: bool = True) -> bool:
    """Whether a tensor-parallel comm term (StageEstimate.tp_comm_s key) is overlapped; `sums`:
    also the reduce-scatters of summed gradients ("reduce_scatter.summed")."""
    if op.startswith("cp.") or (not sums and op.endswith(".summed")):
        return False
    return op.split(".")[0] in OVERLAPPED_OPS


def overlap_tp_comm(tp_comm_s: dict[str, float], *, tp: int, compute_s: float, share: float,
                    sums: bool = True, caps_s: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """(the comm terms with only their exposed seconds, plus "sm_contention"; the seconds the
    stage's time per microbatch changes by: - hidden + contention). `share`: of the SMs the
    overlapped communication holds (contention.sm_share); `sums`: PrecisionPolicy.tp_overlap_sums;
    `caps_s`: per term, the seconds its collectives' own GEMMs can cover (PreparedSegments.
    overlap_caps_s; a term without one: all of it). See the module docstring."""
    if tp <= 1:
        return dict(tp_comm_s), 0.0
    return _hide(tp_comm_s, lambda op: overlappable(op, sums), fraction=(tp - 1) / tp, window_s=compute_s, share=share,
                 caps_s=caps_s)


def overlap_regather(tp_comm_s: dict[str, float], *, backward_s: float, share: float) -> tuple[dict[str, float], float]:
    """PrecisionPolicy.regather_overlap without tp_comm_overlap: each backward re-gather of a kept
    shard runs beside the input-gradient GEMM of the linear that reads it (Megatron-LM, Transformer
    Engine), so it is hidden up to the stage's backward compute, at the SMs its channels hold
    (`share`). Returns as overlap_tp_comm."""
    return _hide(tp_comm_s, lambda op: op == "all_gather.regather", fraction=1.0, window_s=backward_s, share=share)


def _hide(tp_comm_s: dict[str, float], chosen, *, fraction: float, window_s: float,
          share: float, caps_s: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """The `chosen` terms with `fraction` of their seconds hidden, or of their `caps_s` where
    smaller, at most `window_s` in all, each term's hidden seconds scaled alike; the hidden
    seconds add "sm_contention" (their SM `share`)."""
    caps_s = caps_s or {}
    hideable = {op: min(seconds, caps_s.get(op, seconds)) * fraction for op, seconds in tp_comm_s.items() if chosen(op)}
    total = sum(hideable.values())
    hidden = min(total, max(0.0, window_s))
    if hidden <= 0:
        return dict(tp_comm_s), 0.0
    scale = hidden / total
    terms = {op: seconds - hideable.get(op, 0.0) * scale for op, seconds in tp_comm_s.items()}
    contention = hidden * share
    if contention:
        terms["sm_contention"] = terms.get("sm_contention", 0.0) + contention
    return terms, contention - hidden

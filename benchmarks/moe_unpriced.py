"""How Megatron-Core runs three of GPT-OSS's mechanisms, against what the published row prices for them
now (the `moe:` family's expert_bias, swiglu_limit and sliding_window keys, as autopar's runtime runs
them), for each published MoE run (shared/reference/published_moe.csv), by arithmetic on autopar's own
device constants.

    .venv/bin/python benchmarks/moe_unpriced.py [--rows gpt-oss-120b-64,...]

The published row is priced with the model's mechanisms as autopar runs them (published_moe.py):
both expert biases as one gather-and-add each after the grouped matmul (`autopar::expert_bias`,
inside the layer's dispatch/combine chain), the clamped GLU as eager elementwise ops, the windowed
layers as sdpa with a banded mask (the whole square computed). Megatron-Core runs them otherwise;
each is priced here per MoE layer and microbatch on one rank of the published configuration, as
memory-bound kernels of the row's device (ComputeModel: bytes / its bandwidth + kernels x its
launch overhead; dgx-h100: 2.68 TB/s, 5 us), then per step as (microbatches + pp - 1) x the layers
of a stage x that time (1F1B, every stage as many MoE layers), and set against the step change the
planner prices for the same mechanism (the row priced without it). Tokens per rank are microbatch x
seq (tp = cp = 1; rows with tp > 1 are left at 0), rows = tokens x top_k, force-balanced.

    expert biases     Megatron-Core core_v0.17.0 TEGroupedMLP._apply_bias (transformer/moe/experts.py):
                      linear_fc2 has skip_bias_add=True, so its bias is added outside the GEMM, per local
                      expert, `t + b * p` over torch.split(rows, tokens_per_expert), then torch.cat (bf16:
                      the router's probs keep the logits' dtype, TE router.cpp); backward (g*p).sum(0),
                      (g*b).sum(-1) per expert and the split's gradient concatenated. linear_fc1's bias is
                      added inside TE's grouped GEMM (skip_bias_add=False): not counted.
                      (autopar: both biases by `expert_bias`, one kernel each way per projection.)
    clamped GLU       fusions/fused_bias_geglu.weighted_bias_quick_geglu_impl with clamp_value: two eager
                      clamps and a cat around one compiled kernel (quick-GELU x (linear + 1) x prob),
                      recomputed once (moe_act); backward: the compiled kernel, clamp_backward's eager
                      comparisons and where, the chunk's gradient concatenated. Net of what the family
                      prices for silu(gate) x up and the separate x gate after the down projection
                      (FAMILY_GLU_BYTES_PER_ELEMENT). (autopar: the clamps, sigmoid, products
                      and sum as eager kernels, priced as captured.)
    sliding windows   every other layer attends to the last `window` tokens (Megatron-Bridge
                      gpt_oss_bridge: window_size (127, 0), window_attn_skip_freq 2): a query tile
                      of `window` rows meets two key tiles, 2 x window keys, instead of the causal
                      half of seq; priced as the family prices attention (ComputeModel.kernel).
                      (autopar: sdpa with a banded boolean mask, no tile skipped.)

The reorder of the rows around the grouped GEMMs (MoEAlltoAllTokenDispatcher's sort_chunks_by_idxs
with more than one local expert) was listed here and is now priced: ep.reorder (solver/experts.py).

Which run has which feature comes from its model's public config (PUBLIC_FEATURES: gpt-oss's
config.json has expert biases, swiglu_limit 7.0 and sliding_window 128 on alternate layers;
published_moe.PUBLIC_CONFIG builds them). Not computed: the host sync of the dispatcher before each
all-to-all (no host-time model), head_dim-64 attention rates (cost_model/attention.py's documented
kernels are head_dim 128; the MoE rows price attention as a matmul of torch's count, no kernel named).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.published_moe import evaluate_run, read_runs  # noqa: E402
from benchmarks.published_runs import select_rows  # noqa: E402

PUBLIC_FEATURES = {"gpt-oss-120b": ("expert biases", "clamped GLU")}
"""Features of a model's public config.json the reference file's columns do not carry
(openai/gpt-oss-120b: experts' gate_up_proj_bias and down_proj_bias, swiglu_limit 7.0)."""

FAMILY_GLU_BYTES_PER_ELEMENT = 14 + 10 + 38
"""Bytes per element of rows x expert_ffn_hidden that the family's expert activation
moves as captured: forward silu(gate) 4, x up 6, x gate after the down projection 4; the first two
again under moe_act recompute 10; backward the chunk's gradient concatenated 8, silu_backward 6,
the product's two muls 12, the gate's mul, mul and sum 12."""


def layer_costs_s(run, compute) -> dict[str, float]:
    """Seconds per MoE layer and microbatch of each mechanism that applies to `run`, as Megatron-Core
    runs it (the GLU net of the family's silu x up; the windows net of causal attention)."""
    shape, features = run.shape, PUBLIC_FEATURES.get(run.model_name.lower(), ())
    tokens = run.microbatch * shape["seq"] if run.tp == 1 and run.cp == 1 else 0
    rows, hidden = tokens * shape["top_k"], shape["hidden"]
    local = shape["num_experts"] // run.ep

    def memory_s(bytes_per_element: float, kernels: int, width: int = hidden) -> float:
        """Kernels moving bytes_per_element x rows x width."""
        return bytes_per_element * rows * width / compute.bandwidth_bytes_per_s + kernels * compute.overhead_s

    costs = {}
    if "expert biases" in features:
        costs["expert biases"] = memory_s(12, 2 * local + 1) + memory_s(12 + 4, 5 * local + 1)
    if "clamped GLU" in features:
        ffn = shape["expert_ffn_hidden"]
        forward = memory_s(4 + 4 + 8 + 6, 5, ffn)
        costs["clamped GLU"] = (2 * forward + memory_s(10 + 8 + 14 + 8, 9, ffn)
                                - memory_s(FAMILY_GLU_BYTES_PER_ELEMENT, 0, ffn))
    if run.sliding_window:
        costs["sliding windows"] = _window_s(run, compute, tokens)
    return costs


def _window_s(run, compute, tokens: int) -> float:
    """Every other layer's attention with 2 x window keys per query instead of causal, per layer."""
    shape = run.shape
    work = 4 * shape["heads"] * run.head_dim * tokens
    forward, backward = ("aten._scaled_dot_product_flash_attention.default",
                         "aten._scaled_dot_product_flash_attention_backward.default")

    def attention_s(flops: float, causal: bool) -> float:
        return (compute.kernel(flops, 0.0, True, name=forward, causal=causal).total_s
                + compute.kernel(2.5 * flops, 0.0, True, name=backward, causal=causal).total_s)

    full = attention_s(work * shape["seq"], True)
    band = attention_s(work * 2 * run.sliding_window, False)
    return (band - full) / 2


WITHOUT = {"expert biases": lambda run: replace(run, model_keys={k: v for k, v in run.model_keys.items()
                                                                  if k != "expert_bias"}),
           "clamped GLU": lambda run: replace(run, model_keys={k: v for k, v in run.model_keys.items()
                                                               if k != "swiglu_limit"}),
           "sliding windows": lambda run: replace(run, sliding_window=None)}
"""The row without one mechanism: what the planner prices for it is the step's change."""


def main(argv: list[str] | None = None) -> int:
    from autopar.cluster import Cluster
    from cost_model.compute import ComputeModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    args = parser.parse_args(argv)
    for run in select_rows(read_runs(), args.rows):
        cluster = Cluster.from_spec(run.cluster_spec)
        costs = layer_costs_s(run, ComputeModel(cluster.device, cluster.profile))
        step_s = evaluate_run(run, plan=False).published_step_s
        moe_layers = run.shape["layers"] - run.shape.get("dense_layers", 0)
        layers = moe_layers / run.pp
        slots = run.global_batch // (run.dp * run.microbatch) + run.pp - 1
        print(f"{run.id}: as published {run.in_unit(step_s):.4g} {run.metric} (step {step_s:.3g} s), "
              f"published {run.published:g}")
        total_s = 0.0
        for name, seconds in costs.items():
            megatron_s = slots * layers * seconds
            priced_s = step_s - evaluate_run(WITHOUT[name](run), plan=False).published_step_s
            total_s += megatron_s - priced_s
            print(f"  {name:16s} Megatron {1e3 * seconds:+7.3f} ms per layer, {megatron_s:+.3f} s per step; "
                  f"priced now {priced_s:+.3f} s per step; difference {megatron_s - priced_s:+.3f} s")
        with_all = run.in_unit(step_s + total_s)
        print(f"  as Megatron runs them: step {step_s + total_s:.3g} s, {with_all:.4g} "
              f"({with_all / run.published - 1:+.1%})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grouped expert matmuls: out[S, N] = input[S, K] @ weight[e(row), K, N], rows sorted by expert.

Mixture-of-experts layers (Hugging Face's Mixtral, Qwen-MoE...) run every expert's matmul as one
op: `aten._grouped_mm(input, weight, offs)` on GPUs, or the custom ops
`transformers.grouped_mm_fallback(input, weight, offs)` and `autopar.grouped_mm` (the built-in
`moe` family, models/grouped_mm.py), where `offs[e]` is the end row of
expert e's tokens. On one mesh axis:

    col     input R,  weight S2 (N), offs R  -> out S1       each device computes N / n columns
    row     input S1, weight S1 (K), offs R  -> out P        partial sums over K
    expert  input R,  weight S0 (E), offs R  -> out P        each device runs its experts' rows
                                                             (zeros elsewhere: the sum is the op)

The expert strategy's token gradient is partial (each device has its experts' rows of it only),
which the general rule (a split op with a Partial output gives its replicated operands replicated
gradients, true of a row-parallel bias) would miss: the rule states it, so the planner prices the
backward all-reduce that codegen runs.

A per-expert bias after a grouped matmul, `autopar.expert_bias(rows[S, N], bias[E, N], offs[E])`
(rows + bias[e(row)], models/grouped_mm.py), is split like the matmul's columns:

    col     rows S1, bias S1, offs R -> out S1

DTensor has no strategy for these ops: codegen runs them on the local shards (see
codegen/local_ops.py), which is exact for each of these placements.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard

# The graph names a custom op by its bare name ("grouped_mm_fallback.default", "grouped_mm.default",
# see capture._target_name); both spellings of each are registered.
GROUPED_MM_TARGETS = ("aten._grouped_mm.default", "grouped_mm_fallback.default",
                      "transformers.grouped_mm_fallback.default", "grouped_mm.default", "autopar.grouped_mm.default")


EXPERT_BIAS_TARGETS = ("expert_bias.default", "autopar.expert_bias.default")


@register(*EXPERT_BIAS_TARGETS)
def expert_bias(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if not _three_tensors(node, inputs, ranks=(2, 2, 1)):  # rows, bias, offsets
        return []
    return [Strategy1D(inputs=(shard(1), shard(1), REPLICATE), output=shard(1), split=True, name="col")]


@register(*GROUPED_MM_TARGETS)
def grouped_mm(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if not _three_tensors(node, inputs, ranks=(2, 3, 1)):  # tokens, weight, offsets
        return []
    return [
        Strategy1D(inputs=(REPLICATE, shard(2), REPLICATE), output=shard(1), split=True, name="col"),
        Strategy1D(inputs=(shard(1), shard(1), REPLICATE), output=PARTIAL, split=True, name="row"),
        Strategy1D(inputs=(REPLICATE, shard(0), REPLICATE), output=PARTIAL, split=True, name="expert",
                   input_grads=(PARTIAL, "", "")),
    ]


def _three_tensors(node: OpNode, inputs: Sequence[TensorMeta], ranks: tuple[int, int, int]) -> bool:
    """The op reads its three tensor arguments in order, of these ranks."""
    return len(inputs) == 3 and tuple(node.args[:3]) == (Ref(index=0), Ref(index=1), Ref(index=2)) \
        and tuple(len(meta.shape) for meta in inputs) == ranks

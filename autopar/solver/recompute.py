"""What each recomputation mode keeps for backward, decided on the graph (shared by the cost
model in evaluate.py and by codegen, so that what is priced is what runs).

    none       every tensor autograd saves, at the placement its consumer asked for (a
               sequence-sharded norm output all-gathered for a column-parallel matmul is saved
               gathered, at full size)
    gathers    as none, but a saved tensor that an all-gather produced is kept as the shard it
               was gathered from and gathered again in backward (Megatron-LM's sequence
               parallelism: one more all-gather per such tensor in backward, no compute redone)
    selective  Korthikanti et al.: parameter-free ops (attention core, softmax, dropout,
               activations) are recomputed, what parameterized ops save is kept; gathered saves
               are re-gathered as under `gathers`
    op         op-level selective checkpointing as torchtitan's "op" policy: the whole segment is
               checkpointed, and only the outputs of its weight matmuls (every second one, in
               forward order, is recomputed instead), of its attention kernels and of its
               reducing collectives (reduce-scatter, all-reduce) are kept; all-gathers run again
    full       only each segment's inputs are kept; the whole forward runs again

Modes are ordered by what they recompute (none first); the planner tries each where memory
needs it, and a stage takes the first mode that fits.
"""

from __future__ import annotations

from autopar.graph import OpGraph

RECOMPUTE_MODES = ("none", "gathers", "selective", "op", "full")
REGATHER_MODES = ("gathers", "selective")
"""Modes whose kept tensors that came from an all-gather are kept sharded and re-gathered."""

MATMUL_TARGETS = frozenset({"aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
                            "aten.addmm.default", "aten.baddbmm.default", "aten.einsum.default"})
ATTENTION_TARGETS = frozenset({"aten.scaled_dot_product_attention.default",
                               "aten._scaled_dot_product_flash_attention.default",
                               "aten._scaled_dot_product_efficient_attention.default",
                               "aten._scaled_dot_product_cudnn_attention.default"})
"""Fused attention kernels: their output (and log-sum-exp) is kept, as torchtitan's policy does."""


def reads_trainable_param(graph: OpGraph, node) -> bool:
    return any(graph[source].kind == "param" and graph[source].requires_grad for source in node.inputs)


def op_saved_nodes(graph: OpGraph) -> set[str]:
    """Nodes whose outputs the "op" mode keeps: per segment, the 1st, 3rd, 5th... weight matmul
    in forward order (the 2nd, 4th... are recomputed: half the matmul outputs' memory for a part
    of the matmul FLOPs) and every fused attention kernel."""
    saved: set[str] = set()
    for segment in graph.segments:
        num_matmuls = 0
        for name in segment.nodes:
            node = graph[name]
            if node.kind != "call":
                continue
            if node.target in ATTENTION_TARGETS:
                saved.add(name)
            elif node.target in MATMUL_TARGETS and reads_trainable_param(graph, node):
                num_matmuls += 1
                if num_matmuls % 2 == 1:
                    saved.add(name)
    return saved

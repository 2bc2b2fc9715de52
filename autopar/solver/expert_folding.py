"""MoE parallel folding (Liu et al. 2025, arXiv 2504.14960): attention on tp, experts on etp x ep
over the same ranks. autopar prices the expert tensor-parallel degree etp = tp (today's layout:
the intra-op solve may split expert matmuls over tp, and ep borrows dp ranks) and etp = 1 with
tp > 1 ("folded"):

    tokens    an MoE layer is token-local (y[t] depends on x[t] only: router, sort by expert,
              experts, un-sort, weighted sum), so under sequence parallelism each tp rank runs
              the whole layer on its own rows: no tensor-parallel collective inside the layer,
              1/tp of its work on each rank, expert weights whole (not split by tp)
    ep group  drawn from the tp x dp ranks of a pipeline stage, tp innermost: ep consecutive
              ranks of the (dp, tp) grid (ep = 8 with tp = 2 lies inside one 8-GPU node); the
              all-to-alls move each rank's own rows (1/tp of the layer's tokens)
    weights   each rank holds num_experts / ep experts, replicated over the (tp x dp) / ep ranks
              holding the same ones: their gradients are reduced (ZeRO-1/2/3: FSDP-sharded) over
              that group, not over tp

Rule implemented: etp is 1 or tp; folding needs ep > 1, sequence parallelism, cp = 1 and a tp
dividing the sequence; ep must divide tp x dp and every expert layer's experts.

The intra-op solve learns it through fixed strategies (`fixed_token_local`): every op of an MoE
layer's token-local region (`token_local_region`) runs "token-local": each tensor split along
its token dim (the first dim that is a multiple of the sequence length: rows, pairs, or the
sequence itself), parameters and per-expert tensors replicated, the work divided by tp; expert
weights' gradients are complete per rank (reduced in the expert group, step model), the router's
are partial over tp (reduced as sequence-parallel weights are). The region of a layer: from its
entry (walking up from the first expert op's tokens through its one activation input to the
first op with two: the residual add) down to its exit (walking from the last expert op's output through single consumers while they read only the region, factories and
parameters). A DTensor cannot run this region (sorting rows of one rank is not a shard of the
global sort): the runtime runs it on local tensors (codegen/expert_folding.py; with cp = 1 and
the recomputation modes of `runtime_blocker`).
"""

from __future__ import annotations

from autopar.graph import OpGraph, OpNode
from autopar.solver.experts import ExpertOp
from autopar.strategies import Strategy
from autopar.strategies.placement import REPLICATE, shard

RUNS_WITH_RECOMPUTE = ("none", "gathers", "selective", "op", "full")
"""The recomputation modes autopar's runtime runs folded (Megatron-style module sets are not run so)."""


def runtime_blocker(cp: int, recompute: str) -> str:
    """Why autopar's runtime cannot run a folded configuration (codegen/expert_folding.py) with
    these settings ("" when it can): cp = 1 and the modes of RUNS_WITH_RECOMPUTE (every pipeline
    schedule runs). `plan` searches etp = 1 only where it runs; `evaluate` prices the others and
    says this in the plan's notes."""
    unsupported = [f"cp={cp}"] if cp > 1 else []
    if recompute not in RUNS_WITH_RECOMPUTE:
        unsupported.append(f"recompute={recompute!r}")
    if not unsupported:
        return ""
    return (f"autopar's runtime runs MoE parallel folding (etp=1 with tp > 1) with cp=1 and recompute "
            f"{', '.join(RUNS_WITH_RECOMPUTE)}, not {', '.join(unsupported)}: train with etp=tp, or those settings")


TOKEN_LOCAL = "token-local"
"""Name of the fixed strategies of a folded MoE layer's ops."""
_HELD = ("param", "buffer", "constant")


def etp_blocker(tp: int, ep: int, etp: int | None) -> str:
    """Why `etp` is not an expert tensor-parallel degree with this tp and ep ("" when it is one)."""
    if etp is None or etp == tp:
        return ""
    if etp < 1 or tp % etp:
        return f"etp={etp} must divide tp={tp} (the experts' tensor parallelism is a part of the tp ranks)"
    if etp != 1:
        return (f"etp={etp}: autopar prices etp=1 (experts unsplit by tp) or etp=tp={tp} (experts on the tp "
                "solve), not a degree between; use etp=1 or etp=tp")
    if ep == 1:
        return (f"etp=1 with tp={tp} needs ep > 1 (the experts of each tp rank's rows are reached by the ep "
                "all-to-all); set ep or use etp=tp")
    return ""


def token_local_region(graph: OpGraph, ops: tuple[ExpertOp, ...]) -> tuple[str, ...]:
    """Nodes of every MoE layer's token-local region (module docstring), in graph order; () when
    a layer's region does not hold all its expert ops (then nothing folds)."""
    region: set[str] = set()
    for layer in _layers(graph, ops):
        first, last = layer[0], layer[-1]
        found = _layer_region(graph, first, last)
        if found is None or not {op.node for op in layer} <= found:
            return ()
        region |= found
    if not all(op.node in region for op in ops):
        return ()
    return tuple(node.name for node in graph.nodes if node.name in region)


def read_outside(graph: OpGraph, region: tuple[str, ...]) -> tuple[str, ...]:
    """Region nodes an op outside the region reads (one whose output is read in turn: not a dead
    getitem of topk's unused values): each layer's exit, and anything else the runtime could not
    hand out (an auxiliary loss reading the router's logits: each tp rank holds its own tokens')."""
    inside = set(region)
    return tuple(name for name in region if any(consumer not in inside and graph.consumers.get(consumer)
                                                for consumer in graph.consumers.get(name, ())))


def runs_folded(graph: OpGraph, ops: tuple[ExpertOp, ...], region: tuple[str, ...]) -> bool:
    """Whether the runtime can run the region: each layer hands out its exit only."""
    return len(read_outside(graph, region)) <= len(_layers(graph, ops))


def _layers(graph: OpGraph, ops: tuple[ExpertOp, ...]) -> list[list[ExpertOp]]:
    """The expert ops of each MoE layer in graph order: grouped matmuls sharing their `offs`
    (chained or not: GPT-OSS adds a bias between them), an einsum chain, or an einsum alone."""
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    layers: dict[str, list[ExpertOp]] = {}
    by_node = {op.node: op for op in ops}
    for op in sorted(ops, key=lambda op: order[op.node]):
        if op.kind == "grouped_mm":
            key = graph[op.node].inputs[2]
        else:
            start = op
            while start.chain_from:
                start = by_node[start.chain_from]
            key = start.node
        layers.setdefault(key, []).append(op)
    return list(layers.values())


def _activation_inputs(graph: OpGraph, node: OpNode) -> list[OpNode]:
    return [graph[source] for source in dict.fromkeys(node.inputs)
            if graph[source].kind not in _HELD and graph[source].outputs and graph[source].output.is_float]


def _entry(graph: OpGraph, first: ExpertOp) -> OpNode | None:
    node = graph[graph[first.node].inputs[first.token_input]]
    while node.kind == "call":
        activations = _activation_inputs(graph, node)
        if len(activations) != 1:
            return node if len(activations) > 1 else None
        node = activations[0]
    return None


def _layer_region(graph: OpGraph, first: ExpertOp, last: ExpertOp) -> set[str] | None:
    entry = _entry(graph, first)
    if entry is None:
        return None
    below = _descendants(graph, entry.name)
    exit_node = last.node
    while True:
        consumers = graph.consumers.get(exit_node, ())
        if len(consumers) != 1:
            break
        after = graph[consumers[0]]
        if after.kind != "call" or not all(source in below or _factory(graph[source]) for source in after.inputs):
            break
        exit_node = after.name
    above = _ancestors(graph, exit_node, stop=entry.name)
    return (below & above) | {exit_node}


def _factory(node: OpNode) -> bool:
    """A parameter, buffer, constant or an op without inputs (zeros, arange)."""
    return node.kind in _HELD or (node.kind == "call" and not node.inputs)


def _descendants(graph: OpGraph, name: str) -> set[str]:
    found, frontier = set(), [name]
    while frontier:
        for consumer in graph.consumers.get(frontier.pop(), ()):
            if consumer not in found and graph[consumer].kind == "call":
                found.add(consumer)
                frontier.append(consumer)
    return found


def _ancestors(graph: OpGraph, name: str, stop: str) -> set[str]:
    found, frontier = {name}, [name]
    while frontier:
        for source in graph[frontier.pop()].inputs:
            if source not in found and source != stop and graph[source].kind == "call":
                found.add(source)
                frontier.append(source)
    return found


def _weight_derived(graph: OpGraph, region: tuple[str, ...]) -> set[str]:
    """Nodes outside the region the region reads that are made from weights and constants only (a
    weight cast to float32 by DeepSeek-V3's router): whole on every rank, not split by token."""
    inside, found, seen = set(region), set(), {}

    def derived(name: str) -> bool:
        if name not in seen:
            node = graph[name]
            seen[name] = node.kind in _HELD or (node.kind == "call" and bool(node.inputs)
                                                 and all(derived(source) for source in node.inputs))
        return seen[name]

    for name in region:
        for source in graph[name].inputs:
            if source not in inside and graph[source].kind not in _HELD and derived(source):
                found.add(source)
    return found


def token_placement(shape: tuple[int, ...], sequence_length: int) -> str:
    """The placement of a tensor of a token-local region on one tp axis: split along its first
    dim that is a multiple of the sequence length (its tokens), else replicated (per-expert
    counts, scalars)."""
    for dim, size in enumerate(shape):
        if sequence_length and size >= sequence_length and size % sequence_length == 0:
            return shard(dim)
    return REPLICATE


def fixed_token_local(graph: OpGraph, region: tuple[str, ...], ops: tuple[ExpertOp, ...],
                      sequence_length: int) -> dict[str, Strategy]:
    """The fixed strategies (one tp axis) of a folded solve: every region node token-local."""
    whole = {op.param for op in ops} | {view for op in ops for view in op.weight_views}
    # Expert weights and their views (Hugging Face's transposes) replicated on tp: else the solve
    # may split a view and gather it for the grouped matmul.
    fixed = {name: Strategy(inputs=tuple((REPLICATE,) for _ in graph[name].inputs), output=(REPLICATE,),
                            split_axes=(False,), name=TOKEN_LOCAL) for name in whole}
    held = _weight_derived(graph, region)
    for name in region:
        node = graph[name]
        inputs = tuple((REPLICATE,) if graph[source].kind in _HELD or source in whole or source in held else
                       (token_placement(graph[source].output.shape, sequence_length),) for source in node.inputs)
        output = (token_placement(node.output.shape, sequence_length),) if node.outputs else (REPLICATE,)
        split = any(placement != REPLICATE for placement in (output[0], *(p[0] for p in inputs)))
        grads = tuple((REPLICATE if source in whole else "",) for source in node.inputs)
        fixed[name] = Strategy(inputs=inputs, output=output, split_axes=(split,), name=TOKEN_LOCAL,
                               input_grads=grads if any(grad[0] for grad in grads) else ())
    return fixed

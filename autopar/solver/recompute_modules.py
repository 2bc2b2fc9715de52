"""Recomputation by module, as Megatron-Core's `--recompute-modules`: a segment's ops are sorted
into module kinds, decided on the graph (parameter shapes, op kinds, data flow; never model or
class names), and the "modules:<kinds>" mode recomputes the chosen kinds' ops in backward and
keeps what the rest of the segment saves (the "op" machinery of codegen/recompute.py runs it).

    layernorm    the ops of norm modules: a module whose parameters are all 1-D, running no
                 matmul (LayerNorm, RMSNorm, written out or fused)
    core_attn    the attention core: fused attention kernels; for eager attention the score
                 matmul, softmax and value matmul (two matmuls of activations around a softmax)
    moe_act      the row-local ops (elementwise, casts, slices on a non-row dim) between two
                 expert matmuls (solver/experts.py): gate_up -> silu * up -> down
    mlp          a dense MLP: the outermost module below the block with >= 2 matmuls of 2-D
                 weights, no attention core and no expert op, outside any MoE layer
    moe          the ops of the module that holds a layer's expert ops and its routing (the
                 smallest module around the expert ops that runs a top-k): router, permutation,
                 experts, combine
    mla_up_proj  MLA's up-projections: matmuls of 2-D weights inside the attention module that read
                 a norm over the output of a low-rank (down) projection, and the memory-bound ops
                 from their outputs to the attention core (RoPE, splits, q and k concatenated):
                 Megatron-Core checkpoints them as one function (qkv_up_proj_and_rope_apply) and
                 discards its q, k, v after the core attention, recomputing them before its backward

Under "modules:<kinds>" each chosen op, with the ops up to the last one reading its output, forms
a region (SegmentModules.regions) run under a selective checkpoint (codegen/recompute.py's policy):
in a region the outputs the backward saves, those a chosen op reads and every matmul's are kept,
the chosen ops (and memory-bound ops whose outputs nothing saves) run again in backward, so a
chosen op's output, saved by its readers, is not held (Megatron-Core's checkpoint without
output). Outside the regions the segment runs as under "none". A kind the graph
does not hold is refused with the reason, never guessed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from autopar.errors import ConfigError
from autopar.graph import OpGraph
from autopar.solver.experts import find_expert_ops
from autopar.solver.recompute import ATTENTION_TARGETS, MATMUL_TARGETS, RECOMPUTE_MODES
from autopar.solver.recompute_blocks import block_count, blocks_mode, is_blocks_mode
from autopar.strategies.grouped_mm import EXPERT_BIAS_TARGETS

MODULE_KINDS = ("layernorm", "core_attn", "moe_act", "mlp", "moe", "mla_up_proj")
MODULES_PREFIX = "modules:"
SOFTMAX_TARGETS = frozenset({"aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default"})
_EXPERT_TARGETS = frozenset({"grouped_mm.default"})
_REASONS = {
    "layernorm": "no module whose parameters are all 1-D and that runs no matmul (a norm)",
    "core_attn": "no fused attention kernel and no softmax between two matmuls of activations",
    "moe_act": "no pair of expert matmuls with only row-local ops between them",
    "mlp": "no module below a block with two or more matmuls of 2-D weights, no attention and no experts",
    "moe": "no module holding expert matmuls and a top-k routing",
    "mla_up_proj": "no matmul in an attention module that reads a norm over a low-rank projection",
}


def is_modules_mode(mode: str) -> bool:
    return isinstance(mode, str) and mode.startswith(MODULES_PREFIX)


def parse_kinds(text: str, what: str = "--recompute-modules") -> tuple[str, ...]:
    """"layernorm,moe_act" as module kinds (in MODULE_KINDS order), or a ConfigError naming them."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} takes a comma-separated list of module kinds ({', '.join(MODULE_KINDS)}), "
                          f"got {text!r}")
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in MODULE_KINDS]
    if unknown or not kinds:
        raise ConfigError(f"{what}: unknown module kind {', '.join(map(repr, unknown)) or repr(text)}; "
                          f"use a comma-separated list of {', '.join(MODULE_KINDS)}")
    return tuple(kind for kind in MODULE_KINDS if kind in kinds)


def modules_mode(kinds: str | tuple[str, ...], what: str = "--recompute-modules") -> str:
    """The recompute mode string "modules:<kinds>" (checked, in canonical order)."""
    parsed = parse_kinds(kinds if isinstance(kinds, str) else ",".join(kinds), what)
    return MODULES_PREFIX + ",".join(parsed)


def mode_kinds(mode: str) -> tuple[str, ...]:
    """The kinds a "modules:<kinds>" mode recomputes (a ConfigError if malformed)."""
    return parse_kinds(mode[len(MODULES_PREFIX):], f"recompute mode {mode!r}")


def check_recompute(value, what: str = "recompute") -> str:
    """A recomputation mode: one of RECOMPUTE_MODES, "modules:<kinds>" (canonical order) or "blocks:<N>", else a
    ConfigError."""
    if is_modules_mode(value):
        return modules_mode(value[len(MODULES_PREFIX):], what)
    if is_blocks_mode(value):
        return blocks_mode(block_count(value, what))
    if isinstance(value, str) and value in RECOMPUTE_MODES:
        return value
    raise ConfigError(f"{what} must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, 'modules:<kinds>' with "
                      f"kinds from {', '.join(MODULE_KINDS)} (e.g. 'modules:layernorm,moe_act') or 'blocks:<N>' (the "
                      f"first N blocks of each model chunk recomputed in full), got {value!r}")


CANDIDATE_KINDS = (("layernorm", "moe_act"), ("layernorm", "core_attn"))
"""The module sets the search tries beside the other modes, where the model holds every kind
(the published MoE runs recompute norms and expert activations; dense ones norms and attention)."""


def lighter_modes(mode: str) -> tuple[str, ...]:
    """The modes that recompute less than `mode`: those before it in RECOMPUTE_MODES; for
    "modules:<kinds>" (which recomputes a part of what "selective" and "op" do) and "blocks:<N>" (a part
    of what "full" does) "none" and "gathers"."""
    if is_modules_mode(mode) or is_blocks_mode(mode):
        return RECOMPUTE_MODES[:RECOMPUTE_MODES.index("selective")]
    return RECOMPUTE_MODES[:RECOMPUTE_MODES.index(mode)]


@dataclass(frozen=True)
class SegmentModules:
    """One segment's ops by module kind, and what its backward needs."""

    order: tuple[str, ...]
    """The segment's call nodes, in forward order."""
    kinds: dict[str, frozenset[str]]
    """Module kind -> its call nodes in this segment."""
    input_roots: dict[str, frozenset[str]]
    """Module kind -> the segment's call nodes (storage roots) whose outputs its ops read from outside the kind."""
    saved_roots: frozenset[str]
    """The segment's call nodes (storage roots) whose outputs its own ops save for backward."""
    matmuls: frozenset[str]
    """The segment's ops that run matmul kernels (weight matmuls, attention, expert matmuls)."""
    last_reader: dict[str, int]
    """Call node -> position in `order` of the last op reading its output (or a view of it)."""

    @property
    def calls(self) -> frozenset[str]:
        return frozenset(self.order)

    def chosen(self, kinds: tuple[str, ...]) -> frozenset[str]:
        """The chosen kinds' ops."""
        return frozenset().union(*(self.kinds.get(kind, frozenset()) for kind in kinds))

    def regions(self, kinds: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """Contiguous runs of ops checkpointed together: from each chosen op to the last op
        reading its output (merged where they overlap). Outside them nothing is recomputed."""
        chosen = self.chosen(kinds)
        spans: list[list[int]] = []
        for index, name in enumerate(self.order):
            if name not in chosen:
                continue
            stop = max(index, self.last_reader.get(name, index))
            if spans and index <= spans[-1][1] + 1:
                spans[-1][1] = max(spans[-1][1], stop)
            else:
                spans.append([index, stop])
        return tuple(self.order[start:stop + 1] for start, stop in spans)

    def kept(self, kinds: tuple[str, ...]) -> frozenset[str]:
        """Ops inside the regions whose outputs the selective policy keeps: what the backward
        saves, what a chosen op reads and every matmul (no matmul outside the chosen kinds runs
        twice), less the chosen kinds' own ops. The regions' other ops (memory-bound, nothing
        saves their outputs) run again in backward."""
        inside = frozenset(name for region in self.regions(kinds) for name in region)
        needed = self.saved_roots.union(self.matmuls, *(self.input_roots.get(kind, frozenset()) for kind in kinds))
        return (needed & inside) - self.chosen(kinds)

    def recomputed(self, kinds: tuple[str, ...]) -> frozenset[str]:
        """Ops run again in backward: the regions' ops whose outputs are not kept."""
        inside = frozenset(name for region in self.regions(kinds) for name in region)
        return inside - self.kept(kinds)

    def freed(self, kinds: tuple[str, ...]) -> frozenset[str]:
        """Ops whose outputs no recomputation saves (a saved-for-backward tensor) that this mode drops."""
        return self.saved_roots & self.recomputed(kinds)

    def added(self, kinds: tuple[str, ...]) -> frozenset[str]:
        """Ops whose outputs this mode keeps and no recomputation saves (a matmul's output only a
        recomputed op would need again)."""
        return self.kept(kinds) - self.saved_roots


@dataclass(frozen=True)
class ModuleClassification:
    """Every segment's ops by module kind."""

    segments: dict[str, SegmentModules]
    found: frozenset[str]
    """Kinds with at least one op in the graph."""

    def check(self, kinds: tuple[str, ...]) -> None:
        """A ConfigError naming each kind this model does not hold, and why it was not recognised."""
        missing = [kind for kind in kinds if kind not in self.found]
        if missing:
            reasons = "; ".join(f"{kind}: {_REASONS[kind]}" for kind in missing)
            raise ConfigError(f"recompute modules {', '.join(missing)} not found in this model ({reasons}); "
                              f"this model holds {', '.join(k for k in MODULE_KINDS if k in self.found) or 'none'}")

    def candidate_modes(self) -> list[str]:
        """CANDIDATE_KINDS' modes whose kinds this model holds."""
        return [modules_mode(kinds) for kinds in CANDIDATE_KINDS if all(kind in self.found for kind in kinds)]

    def kept_nodes(self, kinds: tuple[str, ...]) -> set[str]:
        """Call nodes of every segment whose outputs "modules:<kinds>" keeps (codegen's kept_nodes)."""
        return set().union(*(segment.kept(kinds) for segment in self.segments.values()))

    def regions(self, kinds: tuple[str, ...]) -> list[tuple[str, ...]]:
        """Every segment's checkpointed regions (SegmentModules.regions)."""
        return [region for segment in self.segments.values() for region in segment.regions(kinds)]


_CACHE: dict[int, tuple[OpGraph, ModuleClassification]] = {}
_CACHE_SIZE = 8


def classify(graph: OpGraph) -> ModuleClassification:
    """Each segment's call nodes by module kind (see the module docstring); the last few graphs' are kept."""
    cached = _CACHE.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    classification = _classify(graph)
    _CACHE[id(graph)] = (graph, classification)
    return classification


def _classify(graph: OpGraph) -> ModuleClassification:
    nodes_by_kind = {"layernorm": _norm_nodes(graph), "core_attn": _core_attention_nodes(graph)}
    nodes_by_kind["moe_act"] = _expert_activation_nodes(graph)
    moe_paths = _moe_modules(graph)
    nodes_by_kind["moe"] = {node.name for node in graph.calls() if _under_any(node.module_path, moe_paths)}
    nodes_by_kind["mlp"] = _mlp_nodes(graph, nodes_by_kind["core_attn"], moe_paths)
    nodes_by_kind["mla_up_proj"] = _mla_up_nodes(graph, nodes_by_kind["layernorm"], nodes_by_kind["core_attn"])
    segments = {}
    for segment in graph.segments:
        order = tuple(name for name in segment.nodes if graph[name].kind == "call")
        calls = frozenset(order)
        kinds = {kind: frozenset(nodes & calls) for kind, nodes in nodes_by_kind.items() if nodes & calls}
        inputs = {kind: frozenset(graph.storage_root(source) for name in nodes for source in graph[name].inputs
                                  if graph.storage_root(source) not in nodes) for kind, nodes in kinds.items()}
        matmuls = frozenset(name for name in calls if graph[name].fwd_flops > 0 or _is_matmul(graph[name]))
        last_reader: dict[str, int] = {}
        for index, name in enumerate(order):
            for source in _data_inputs(graph[name]):
                last_reader[graph.storage_root(source)] = index
        segments[segment.name] = SegmentModules(order=order, kinds=kinds, input_roots=inputs,
                                                saved_roots=frozenset(_saved_roots(graph, calls) & calls),
                                                matmuls=matmuls, last_reader=last_reader)
    return ModuleClassification(segments=segments, found=frozenset(k for k, nodes in nodes_by_kind.items() if nodes))


_SHAPE_ONLY = frozenset({"aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default",
                         "aten.full_like.default"})


def _data_inputs(node) -> tuple[str, ...]:
    """The inputs whose values `node` reads: a view reads the tensor it views (view_as's template
    and a *_like op's operand only lend their shapes)."""
    if node.target in _SHAPE_ONLY:
        return ()
    if node.alias_input is not None:
        return (node.inputs[node.alias_input],)
    return node.inputs


def _saved_roots(graph: OpGraph, names) -> set[str]:
    """Storage roots of what the ops `names` save for backward (a gated activation saved as a
    recipe, activation_saves.py, is not: without it the checkpoint's replay runs it again)."""
    roots: set[str] = set()
    for name in names:
        node = graph[name]
        sources = [node.inputs[index] for index in node.saved_inputs]
        if node.saved_output or node.saved_extra_bytes:
            sources.append(node.name)
        roots.update(graph.storage_root(source) for source in sources)
    return roots


def _params_of(graph: OpGraph, node) -> list:
    return [graph[source] for source in node.inputs if graph[source].kind == "param" and graph[source].requires_grad]


def _is_matmul(node) -> bool:
    return node.target in MATMUL_TARGETS or node.target in ATTENTION_TARGETS or node.target in _EXPERT_TARGETS


def _modules(graph: OpGraph) -> dict[str, list]:
    """Module path -> the call nodes run inside it (its submodules' included), for paths below the root."""
    modules: dict[str, list] = defaultdict(list)
    for node in graph.calls():
        parts = node.module_path.split(".") if node.module_path and not node.module_path.startswith("<") else []
        for depth in range(1, len(parts) + 1):
            modules[".".join(parts[:depth])].append(node)
    return modules


def _under_any(path: str, prefixes) -> bool:
    return any(path == prefix or path.startswith(prefix + ".") for prefix in prefixes)


def _norm_nodes(graph: OpGraph) -> set[str]:
    found: set[str] = set()
    for nodes in _modules(graph).values():
        params = [param for node in nodes for param in _params_of(graph, node)]
        if params and all(len(param.output.shape) == 1 for param in params) and not any(map(_is_matmul, nodes)):
            found.update(node.name for node in nodes)
    return found


def _core_attention_nodes(graph: OpGraph) -> set[str]:
    found = {node.name for node in graph.calls() if node.target in ATTENTION_TARGETS}
    activation_matmuls = [node for node in graph.calls()
                          if node.target in MATMUL_TARGETS and not _params_of(graph, node)]
    names = {node.name for node in activation_matmuls}
    for value_matmul in activation_matmuls:
        between = _ancestors(graph, value_matmul.name, stop=names)
        if any(graph[name].target in SOFTMAX_TARGETS for name in between) and any(name in names for name in between):
            found |= {value_matmul.name, *(name for name in between if not _params_of(graph, graph[name]))}
    return found


def _ancestors(graph: OpGraph, name: str, stop: set[str]) -> set[str]:
    """Call nodes upstream of `name` up to (and including) the first nodes in `stop` or with weights."""
    seen: set[str] = set()
    todo = list(graph[name].inputs)
    while todo:
        source = todo.pop()
        node = graph[source]
        if source in seen or node.kind != "call":
            continue
        seen.add(source)
        through = not _params_of(graph, node) or node.target in EXPERT_BIAS_TARGETS  # a per-expert bias: row-local
        if source not in stop and through and not _is_matmul(node):
            todo.extend(node.inputs)
    return seen


def _expert_activation_nodes(graph: OpGraph) -> set[str]:
    experts = {op.node for op in find_expert_ops(graph)}
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    found: set[str] = set()
    for name in experts:
        between = _ancestors(graph, name, stop=experts)
        first = {source for source in between if source in experts}
        if not first:
            continue
        rows = graph[next(iter(first))].output.shape[0]
        reached = set(first)
        for source in sorted(between - first, key=order.__getitem__):  # forward from the first expert ops
            if any(parent in reached for parent in graph[source].inputs):
                reached.add(source)
        path = reached - first
        if path and all(_row_local(graph[source], rows) for source in path):
            found |= path
    return found


def _row_local(node, rows: int) -> bool:
    return not _is_matmul(node) and bool(node.outputs) and len(node.output.shape) >= 1 \
        and node.output.shape[0] == rows and node.target not in SOFTMAX_TARGETS


def _moe_modules(graph: OpGraph) -> set[str]:
    modules = _modules(graph)
    paths: set[str] = set()
    for op in find_expert_ops(graph):
        parts = graph[op.node].module_path.split(".")
        for depth in range(len(parts), 0, -1):
            path = ".".join(parts[:depth])
            if any(node.target == "aten.topk.default" for node in modules.get(path, ())):
                paths.add(path)
                break
    return paths


def _mlp_nodes(graph: OpGraph, attention: set[str], moe_paths: set[str]) -> set[str]:
    blocks = {segment.name for segment in graph.segments if segment.block_group is not None}
    found: set[str] = set()
    chosen: list[str] = []
    for path, nodes in sorted(_modules(graph).items(), key=lambda item: item[0].count(".")):
        if path in blocks or _under_any(path, chosen) or _under_any(path, moe_paths) or \
                not any(_under_any(path, [block]) for block in blocks):
            continue
        weights = [node for node in nodes if node.target in MATMUL_TARGETS
                   and any(len(param.output.shape) == 2 for param in _params_of(graph, node))]
        if len(weights) >= 2 and not any(node.name in attention or node.target in _EXPERT_TARGETS
                                         or node.target in SOFTMAX_TARGETS for node in nodes):
            chosen.append(path)
            found.update(node.name for node in nodes)
    return found


def _mla_up_nodes(graph: OpGraph, norms: set[str], attention: set[str]) -> set[str]:
    attention_paths = {graph[name].module_path for name in attention}
    found: set[str] = set()
    for node in graph.calls():
        if node.target not in MATMUL_TARGETS or not _under_any(node.module_path, attention_paths) \
                or not any(len(param.output.shape) == 2 for param in _params_of(graph, node)):
            continue
        for source in node.inputs:
            if graph.storage_root(source) in norms and any(
                    low.target in MATMUL_TARGETS and _is_low_rank(graph, low)
                    for low in _norm_sources(graph, graph.storage_root(source), norms)):
                found.add(node.name)
    return found | _up_to_attention(graph, found, attention, attention_paths)


def _up_to_attention(graph: OpGraph, starts: set[str], attention: set[str], attention_paths) -> set[str]:
    """The memory-bound ops of the attention module that the up-projections' (`starts`) outputs
    reach before the attention core: RoPE, splits, the concatenation of q and k (which also
    reads the shared rotary key)."""
    consumers, found, todo = graph.consumers, set(), list(starts)
    while todo:
        for reader in consumers.get(todo.pop(), ()):
            node = graph[reader]
            if reader in found or reader in attention or node.kind != "call" or _is_matmul(node) \
                    or node.fwd_flops > 0 or not _under_any(node.module_path, attention_paths):
                continue
            found.add(reader)
            todo.append(reader)
    return found


def _norm_sources(graph: OpGraph, name: str, norms: set[str]) -> list:
    """The ops (storage roots) whose outputs the norm ending at `name` normalizes."""
    sources, todo, seen = [], [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for source in graph[current].inputs:
            root = graph.storage_root(source)
            if root in norms:
                todo.append(root)
            elif graph[root].kind == "call":
                sources.append(graph[root])
    return sources


def _is_low_rank(graph: OpGraph, node) -> bool:
    """A down projection: a 2-D weight whose output width is below its input width."""
    weights = [param for param in _params_of(graph, node) if len(param.output.shape) == 2]
    return any(weight.output.shape[0] < weight.output.shape[1] for weight in weights)

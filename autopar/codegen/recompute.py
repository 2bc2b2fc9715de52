"""The runtime side of two recomputation modes (autopar/solver/recompute.py says what each keeps).

"op": a segment runs under torch.utils.checkpoint with a selective policy
(`create_selective_checkpoint_contexts`). The interpreter names the graph node it is running,
and the policy keeps (MUST_SAVE) what the ops of a kept node produce, except views (a matmul's
transposed weight is a view of a gathered FSDP parameter, which must not be pinned), plus the
outputs of reducing collectives wherever they run; everything else is recomputed in backward
from the segment's inputs and the kept tensors, all-gathers included. The policy sees the same
op sequence in the recompute as in the forward (the interpreter runs the same nodes), which is
what the selective-checkpoint cache requires.

"modules:<kinds>": only the regions around the chosen module kinds' ops (solver/recompute_modules.py)
run under the same policy, each as its own checkpoint; the rest of the segment runs as under "none".

"gathers" (and the kept parts of "selective"): saved-tensor hooks replace a saved tensor that the
interpreter all-gathered from a shard by a token holding the shard; backward gathers it again,
once for all the consumers that saved it (q, k and v projections share one gather), and drops
it after the last of them, as Megatron-LM's sequence parallelism does.

Every mode that keeps tensors (all but "full" and what "op" and "selective" recompute): the same
hooks save a gated activation's output as a recipe (autopar/capture/activation_saves.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.solver.recompute import op_saved_nodes
from autopar.solver.recompute_modules import classify, is_modules_mode, mode_kinds

def checkpointed(mode: str) -> bool:
    """Modes that run the whole segment under torch.utils.checkpoint ("full", and "op"'s policy)."""
    return mode in ("full", "op")


def kept_nodes(graph, mode: str) -> set[str]:
    """Nodes whose outputs the selective policy keeps under `mode` ("op" or "modules:<kinds>"):
    solver/recompute.py and solver/recompute_modules.py decide them, as they are priced."""
    if is_modules_mode(mode):
        return classify(graph).kept_nodes(mode_kinds(mode))
    return op_saved_nodes(graph)


def checkpoint_regions(graph, mode: str) -> list[tuple[str, ...]]:
    """Under "modules:<kinds>", the runs of nodes checkpointed together (recompute_modules.py);
    none under the other modes."""
    return classify(graph).regions(mode_kinds(mode)) if is_modules_mode(mode) else []


def region_nodes(nodes, regions: list[tuple[str, ...]]) -> set[str] | None:
    """The names of `nodes` (a segment's fx nodes, in order) inside the regions: from each region's
    first node to its last, helper nodes between them included (None without regions)."""
    if not regions:
        return None
    position = {node.name: index for index, node in enumerate(nodes)}
    inside: set[str] = set()
    for region in regions:
        indices = [position[name] for name in region if name in position]
        if indices:
            inside.update(node.name for node in nodes[min(indices):max(indices) + 1])
    return inside


_KEPT_COLLECTIVES = frozenset(
    getattr(torch.ops._c10d_functional, name).default for name in ("reduce_scatter_tensor", "all_reduce")
    if hasattr(torch.ops._c10d_functional, name))


MUTATING_CPU_DECOMPOSITIONS = frozenset({"aten.rms_norm.default"})
"""Ops whose CPU kernels run as a decomposition that writes into one of its own intermediates
(rms_norm: pow, mean, add_ on the mean, rsqrt, mul): a selective checkpoint refuses a tensor
mutated after it kept it ("Tensor cached during selective activation checkpoint has been
mutated"), so on the CPU such a kept node runs again in backward instead (its input is kept
anyway; CUDA runs rms_norm as one fused kernel, which is kept)."""


def mutating_on_cpu(nodes, kept_nodes: set[str]) -> frozenset[str]:
    """The kept nodes among `nodes` (fx nodes) whose op is in MUTATING_CPU_DECOMPOSITIONS."""
    return frozenset(node.name for node in nodes
                     if node.name in kept_nodes and str(node.target) in MUTATING_CPU_DECOMPOSITIONS)


def op_policy_context(interpreter, kept_nodes: set[str], cpu_recomputed: frozenset[str] = frozenset()):
    """`context_fn` for torch.utils.checkpoint under the "op" and "modules:<kinds>" modes;
    `cpu_recomputed`: kept nodes run again in backward where their op runs on the CPU
    (mutating_on_cpu)."""

    def policy(ctx, func, *args, **kwargs):
        node = interpreter.current_node
        if func in _KEPT_COLLECTIVES or (node in kept_nodes and not func.is_view
                                         and not (node in cpu_recomputed and _on_cpu(args))):
            if not ctx.is_recompute:
                interpreter.stats.kept["op"] += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def _on_cpu(args) -> bool:
    return any(isinstance(arg, torch.Tensor) and arg.device.type == "cpu" for arg in args)


@dataclass
class _Gathered:
    """A tensor the interpreter gathered from `shard`, saved for backward as a token."""

    shard: torch.Tensor
    placements: tuple
    numel: int
    pending: int = 0
    full: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                self.full = self.shard.redistribute(self.shard.device_mesh, self.placements)
        self.pending -= 1
        full = self.full
        if self.pending <= 0:
            self.full = None
        return full


@dataclass(frozen=True)
class _Token:
    gathered: _Gathered
    shape: torch.Size


def _storage_key(tensor: torch.Tensor) -> int:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage: never matched
        return 0


@dataclass(frozen=True)
class _Activation:
    """A gated activation's output, saved as its function and its (already saved) input."""

    function: object
    source: torch.Tensor
    other_args: tuple
    kwargs: dict
    output: weakref.ref

    def matches(self, tensor: torch.Tensor) -> bool:
        return self.output() is tensor

    def run(self) -> torch.Tensor:
        with torch.no_grad():
            return self.function(self.source, *self.other_args, **self.kwargs)


@contextmanager
def compact_saves(interpreter, regather: bool):
    """Within this block, tensors autograd saves are kept smaller where the plan says so:
    gathered inputs as the shards they came from (`regather`: the "gathers" mode and the kept
    parts of "selective"), and gated activations' outputs as a recipe run again in backward from
    the activation's input, which its own backward keeps anyway (autopar/capture/activation_saves.py)."""
    gathered: dict[int, _Gathered] = {}
    activations: dict[int, _Activation] = {}

    def note_gather(shard: DTensor, full: DTensor) -> None:
        key = _storage_key(full)
        if key:
            gathered[key] = _Gathered(shard=shard.detach(), placements=tuple(full.placements), numel=full.numel())

    def note_activation(node, args, kwargs, output) -> None:
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            activations[id(output)] = _Activation(function=node.target, source=args[0].detach(),
                                                  other_args=tuple(args[1:]), kwargs=dict(kwargs),
                                                  output=weakref.ref(output))

    def pack(tensor):
        recipe = activations.get(id(tensor))
        if recipe is not None and recipe.matches(tensor):
            interpreter.stats.kept["recomputed_activation"] += 1
            return recipe
        if isinstance(tensor, DTensor) and gathered:
            entry = gathered.get(_storage_key(tensor))
            # Only whole, contiguous views of the gathered tensor (the 2-D view a matmul saves).
            if entry is not None and tensor.numel() == entry.numel and tensor.is_contiguous() \
                    and tensor._local_tensor.storage_offset() == 0:
                entry.pending += 1
                interpreter.stats.kept["regathered"] += 1
                return _Token(gathered=entry, shape=tensor.shape)
        return tensor

    def unpack(packed):
        if isinstance(packed, _Token):
            return packed.gathered.take().view(packed.shape)
        if isinstance(packed, _Activation):
            return packed.run()
        return packed

    regather = regather and interpreter.distributed
    if not regather and not interpreter.recomputed_activations:
        yield
        return
    previous = interpreter.on_gather, interpreter.on_activation
    interpreter.on_gather = note_gather if regather else None
    interpreter.on_activation = note_activation
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        interpreter.on_gather, interpreter.on_activation = previous

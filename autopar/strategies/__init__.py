"""Sharding strategies: for each op, the legal (input placements -> output placement) choices.

Each op family lives in its own module and registers a generator per aten target:

    @register("aten.gelu.default", ...)
    def unary(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]

A generator describes ONE mesh axis of `axis_size` devices; `mesh_strategies` combines them
into strategies for a whole mesh (one 1-D choice per axis, checked for even divisibility).
The semantics are DTensor's, so codegen can realise any choice with DTensor ops. Ops without
a generator get the replicate-only strategy and are reported.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.graph import OpNode, TensorMeta
from autopar.strategies.placement import PARTIAL, REPLICATE, is_shard, shard_dim, shards_on_dim


@dataclass(frozen=True)
class Strategy1D:
    """One way to run an op across one mesh axis."""

    inputs: tuple[str, ...]
    """Placement each tensor input must have (same order as OpNode.inputs)."""
    output: str
    """Placement of the output (of every output, for multi-output ops)."""
    split: bool
    """The op's work is divided among the axis' devices (False: every device does all of it)."""
    name: str = ""
    """Short label for reports: "batch", "col", "row", "heads", "vocab"..."""
    input_grads: tuple[str, ...] = ()
    """Per input, the placement of the gradient the op produces for it where `Strategy.input_grad`'s
    rule does not tell ("" or empty: the rule)."""
    collectives: tuple[tuple[str, str, float], ...] = ()
    """Collectives the op's own rule runs on this axis, beyond any resharding of its inputs (a
    vocab-parallel loss all-reduces its row maxima): (op, phase "fwd"/"bwd", message bytes)."""
    backward_copies: float = 0.0
    """Temporaries the op's backward under this rule holds at once beyond the gradients, in
    local copies of its first input (DTensor's vocab-parallel cross-entropy: 1, its exp(x) beside
    the zeros it scatters the targets into; aten's fused kernels: 0)."""


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on a whole mesh: a Strategy1D per mesh axis."""

    inputs: tuple[tuple[str, ...], ...]
    """Per tensor input, its placement on each mesh axis."""
    output: tuple[str, ...]
    """Output placement on each mesh axis."""
    split_axes: tuple[bool, ...]
    """Per mesh axis, whether the work is divided on it."""
    name: str = ""
    input_grads: tuple[tuple[str, ...], ...] = ()
    """Per tensor input, per mesh axis, its gradient's placement when the op's rule states it
    ("": derived by `input_grad`'s rule); empty: derived everywhere."""
    collectives: tuple[tuple[str, int, str, float], ...] = ()
    """The op's own collectives (Strategy1D.collectives): (op, mesh axis, phase, message bytes)."""
    backward_copies: float = 0.0
    """Strategy1D.backward_copies, the most of any axis (one rule runs the op)."""

    def work_divisor(self, mesh_shape: Sequence[int]) -> int:
        divisor = 1
        for split, size in zip(self.split_axes, mesh_shape):
            if split:
                divisor *= size
        return divisor

    def input_grad(self, index: int, axis: int, requires_grad: bool) -> str:
        """Placement of the gradient this op produces for input `index` on `axis`: a replicated
        input of an op whose work is split into shards, or that meets a partial operand, receives
        a partial gradient from each device."""
        if self.input_grads and self.input_grads[index][axis]:
            return self.input_grads[index][axis]
        placement = self.inputs[index][axis]
        if placement == PARTIAL:
            return REPLICATE
        # mul(P, R): the gradient of the replicated factor involves the partial one. A split op
        # with a Partial output (row-parallel linear) gets a replicated output gradient, so a
        # replicated operand of it (the bias) has a replicated gradient.
        partial_neighbour = any(inputs[axis] == PARTIAL for i, inputs in enumerate(self.inputs) if i != index)
        split_into_shards = self.split_axes[axis] and self.output[axis] != PARTIAL
        if placement == REPLICATE and requires_grad and (split_into_shards or partial_neighbour):
            return PARTIAL
        return placement


Generator = Callable[[OpNode, Sequence[TensorMeta], int], list[Strategy1D]]
_REGISTRY: dict[str, Generator] = {}


def register(*targets: str) -> Callable[[Generator], Generator]:
    def decorate(generator: Generator) -> Generator:
        for target in targets:
            _REGISTRY[target] = generator
        return generator

    return decorate


def replicate_all(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int = 1) -> list[Strategy1D]:
    return [Strategy1D(inputs=tuple(REPLICATE for _ in inputs), output=REPLICATE, split=False, name="replicate")]


def has_rule(target: str) -> bool:
    _load_families()
    return target in _REGISTRY


def strategies_1d(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    """Legal strategies on one axis (replicate is always among them)."""
    _load_families()
    generator = _REGISTRY.get(node.target)
    found = generator(node, inputs, axis_size) if generator and axis_size > 1 else []
    replicated = replicate_all(node, inputs)[0]
    unique = list(dict.fromkeys([replicated] + found))
    if _copies(node):  # DTensor all-reduces a Partial tensor before copying it
        unique = [strategy for strategy in unique if PARTIAL not in strategy.inputs]
    return [strategy for strategy in unique if _fits(strategy, node, inputs, axis_size)]


def _copies(node: OpNode) -> bool:
    """Whether the op copies an input (a reshape of a non-contiguous tensor, matmul folding batch
    dims): seen at capture as a clone kernel."""
    return any(kernel.name.startswith("aten.clone") for kernel in node.fwd_kernels)


def mesh_strategies(node: OpNode, inputs: Sequence[TensorMeta], mesh_shape: Sequence[int]) -> list[Strategy]:
    """Every combination of per-axis strategies whose shards divide the tensors evenly."""
    per_axis = [strategies_1d(node, inputs, size) for size in mesh_shape]
    combined = []
    for choice in itertools.product(*per_axis):
        strategy = Strategy(
            inputs=tuple(tuple(axis.inputs[i] for axis in choice) for i in range(len(inputs))),
            output=tuple(axis.output for axis in choice),
            split_axes=tuple(axis.split for axis in choice),
            name="+".join(axis.name for axis in choice),
            input_grads=_input_grads(choice, len(inputs)),
            collectives=tuple((op, axis, phase, size) for axis, one in enumerate(choice)
                              for op, phase, size in one.collectives),
            backward_copies=max(axis.backward_copies for axis in choice),
        )
        if _fits_mesh(strategy, node, inputs, mesh_shape):
            combined.append(strategy)
    return combined


def _input_grads(choice: Sequence[Strategy1D], num_inputs: int) -> tuple[tuple[str, ...], ...]:
    """The per-axis gradient placements the 1-D rules state, or () when none does."""
    if not any(axis.input_grads for axis in choice):
        return ()
    return tuple(tuple(axis.input_grads[i] if axis.input_grads else "" for axis in choice) for i in range(num_inputs))


def _fits(strategy: Strategy1D, node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> bool:
    metas = list(zip(strategy.inputs, inputs)) + [(strategy.output, meta) for meta in node.outputs]
    for placement, meta in metas:
        if is_shard(placement):
            dim = shard_dim(placement)
            if dim >= len(meta.shape) or meta.shape[dim] % axis_size:
                return False
    return True


def _fits_mesh(strategy: Strategy, node: OpNode, inputs: Sequence[TensorMeta], mesh_shape: Sequence[int]) -> bool:
    tensors = list(zip(strategy.inputs, inputs)) + [(strategy.output, meta) for meta in node.outputs]
    for placements, meta in tensors:
        for dim in {shard_dim(p) for p in placements if is_shard(p)}:
            if meta.shape[dim] % shards_on_dim(placements, dim, mesh_shape):
                return False
    return True


_LOADED = False


def _load_families() -> None:
    """Import the family modules (each registers its targets)."""
    global _LOADED
    if _LOADED:
        return
    from autopar.strategies import families  # noqa: F401

    _LOADED = True

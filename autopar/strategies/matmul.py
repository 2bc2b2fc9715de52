"""Matmul family (linear, mm, addmm, bmm, baddbmm, matmul, einsum) from einsum-like specs.

Every op is written as operands' dimension letters -> output letters. Sharding one letter on an
axis shards every operand that has it; an operand without it is replicated. A contracted letter
gives a Partial output (Megatron's row-parallel linear); a letter kept in the output gives a
sharded output (column-parallel, batch, heads). Matmuls are linear in each operand, so one
Partial operand with the others replicated gives a Partial output. A replicated bias with a
Partial output is added once: DTensor's rule divides it among the devices, with no collective.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard


@dataclass(frozen=True)
class EinsumSpec:
    operands: tuple[str, ...]
    """Letters of each tensor input, in OpNode.inputs order."""
    output: str
    additive: tuple[bool, ...]
    """Per operand: added to the product (a bias) rather than multiplied."""


def einsum_strategies(spec: EinsumSpec, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    sizes = _letter_sizes(spec, inputs)
    strategies = []
    for letter in dict.fromkeys("".join(spec.operands) + spec.output):
        if sizes.get(letter, 1) % axis_size or sizes.get(letter, 1) < axis_size:
            continue
        contracted = letter not in spec.output
        placements = []
        for letters, additive, meta in zip(spec.operands, spec.additive, inputs):
            position = letters.find(letter)
            if position >= 0 and meta.shape[position] == sizes[letter]:
                placements.append(shard(position))
            else:  # an additive operand of a contracted letter stays replicated: DTensor's rule
                placements.append(REPLICATE)  # adds it once (bias / n on each device) without comm
        output = PARTIAL if contracted else shard(spec.output.index(letter))
        strategies.append(Strategy1D(inputs=tuple(placements), output=output, split=True,
                                     name=_role(letter, spec)))
    for index, additive in enumerate(spec.additive):
        if not additive:  # linear in this operand: Partial in, Partial out
            placements = tuple(PARTIAL if i == index else REPLICATE for i in range(len(spec.operands)))
            strategies.append(Strategy1D(inputs=placements, output=PARTIAL, split=False, name="partial"))
    return strategies


def _letter_sizes(spec: EinsumSpec, inputs: Sequence[TensorMeta]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for letters, meta in zip(spec.operands, inputs):
        for letter, size in zip(letters, meta.shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return sizes


def _role(letter: str, spec: EinsumSpec) -> str:
    multiplied = [letters for letters, additive in zip(spec.operands, spec.additive) if not additive]
    in_all = all(letter in letters for letters in multiplied)
    if letter not in spec.output:
        return "row"  # contracted: partial sums
    if in_all:
        return "batch"
    if len(multiplied) > 1 and letter in multiplied[-1] and letter not in multiplied[0]:
        return "col"
    return f"dim{spec.output.index(letter)}"


def _letters(count: int, start: int = 0) -> str:
    return string.ascii_letters[start:start + count]


def _batch_letters(rank: int) -> str:
    return _letters(rank, start=26)  # upper case: batch dims


def linear_spec(inputs: Sequence[TensorMeta]) -> EinsumSpec:
    """linear(x[..., k], w[n, k], bias[n]) -> [..., n]"""
    batch = _batch_letters(len(inputs[0].shape) - 1)
    operands = (batch + "k", "nk") + (("n",) if len(inputs) > 2 else ())
    return EinsumSpec(operands=operands, output=batch + "n", additive=(False, False, True)[:len(operands)])


def matmul_spec(inputs: Sequence[TensorMeta]) -> EinsumSpec | None:
    """matmul/mm/bmm with broadcasting batch dims: a[..., m, k] @ b[..., k, n]."""
    a_rank, b_rank = len(inputs[0].shape), len(inputs[1].shape)
    if a_rank < 2 or b_rank < 1:
        return None
    if b_rank == 1:
        batch = _batch_letters(a_rank - 1)
        return EinsumSpec(operands=(batch + "k", "k"), output=batch, additive=(False, False))
    out_rank = max(a_rank, b_rank)
    batch = _batch_letters(out_rank - 2)
    a_letters = batch[len(batch) - (a_rank - 2):] + "mk" if a_rank > 2 else "mk"
    b_letters = batch[len(batch) - (b_rank - 2):] + "kn" if b_rank > 2 else "kn"
    return EinsumSpec(operands=(a_letters, b_letters), output=batch + "mn", additive=(False, False))


def _input_order(node: OpNode) -> list[int]:
    """Positions (in the call's argument order) of the tensor inputs."""
    return [arg.index for arg in node.args if isinstance(arg, Ref)]


@register("aten.linear.default")
def linear(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if len(inputs) < 2 or _input_order(node) != list(range(len(inputs))):
        return []
    return einsum_strategies(linear_spec(inputs), inputs, axis_size)


@register("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def matmul(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if len(inputs) != 2:
        return []
    spec = matmul_spec(inputs)
    if spec is None:
        return []
    return einsum_strategies(spec, inputs, axis_size)


@register("aten.addmm.default", "aten.baddbmm.default")
def addmm(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if len(inputs) != 3:
        return []
    product = matmul_spec(inputs[1:])
    bias_rank = len(inputs[0].shape)
    bias = product.output[len(product.output) - bias_rank:]
    spec = EinsumSpec(operands=(bias,) + product.operands, output=product.output, additive=(True, False, False))
    return einsum_strategies(spec, inputs, axis_size)


@register("aten.einsum.default")
def einsum(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else None
    if equation is None or "..." in equation or "->" not in equation:
        return []
    left, output = equation.replace(" ", "").split("->")
    operands = tuple(left.split(","))
    if len(operands) != len(inputs) or any(len(op) != len(meta.shape) for op, meta in zip(operands, inputs)):
        return []
    spec = EinsumSpec(operands=operands, output=output, additive=tuple(False for _ in operands))
    return einsum_strategies(spec, inputs, axis_size)

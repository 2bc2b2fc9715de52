"""Embedding family: embedding(weight[vocab, hidden], indices[...]) -> [..., hidden].

Three ways to split the lookup on one axis (DTensor, torch 2.13, `_embedding_ops.py`):

  - "batch" (any indices dim): indices sharded on that dim, weight replicated; the output is
    sharded on the same dim.
  - "hidden" (column-wise): weight sharded on dim 1, indices replicated; output sharded on its last dim.
  - "vocab" (row-wise, Megatron's vocab-parallel embedding): weight sharded on dim 0, indices
    replicated; each device looks up only the rows it holds and the output is the sum over
    devices, reported as P.

The vocab-parallel P is not an ordinary Partial in DTensor: it is a `_MaskPartial` whose local
rows for out-of-range indices are garbage until the reduction applies a mask. DTensor therefore
all-reduces it before ops such as add or mul (even with another P operand) and fails on a view
of it (IndexError on the mask). Codegen should redistribute a vocab-parallel output (to R by
all-reduce, or to S by reduce-scatter) right after the embedding.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph import OpNode, Ref, TensorMeta
from autopar.strategies import Strategy1D, register
from autopar.strategies.placement import PARTIAL, REPLICATE, shard


@register("aten.embedding.default")
def embedding(node: OpNode, inputs: Sequence[TensorMeta], axis_size: int) -> list[Strategy1D]:
    if len(inputs) != 2 or tuple(node.args[:2]) != (Ref(index=0), Ref(index=1)):
        return []
    num_index_dims = len(inputs[1].shape)
    strategies = [Strategy1D(inputs=(REPLICATE, shard(dim)), output=shard(dim), split=True,
                             name="batch" if dim == 0 else f"dim{dim}")
                  for dim in range(num_index_dims)]
    strategies.append(Strategy1D(inputs=(shard(1), REPLICATE), output=shard(num_index_dims), split=True,
                                 name="hidden"))
    strategies.append(Strategy1D(inputs=(shard(0), REPLICATE), output=PARTIAL, split=True, name="vocab"))
    return strategies

"""Which linears of a graph run in float8 under precision "fp8" (torchao float8 training).

torchao's float8 training (`convert_to_float8_training`) swaps nn.Linear modules for Float8Linear;
torchtitan converts every linear of the model but the output head, and torchao's own auto filter
keeps a linear in high precision when a dimension of its weight is not a multiple of 16 (the fp8
tensor cores' `torch._scaled_mm` needs both). The default rule here is the same, read off the
captured graph rather than the module tree, so a plan records the choice as data (Plan.fp8_linears)
and codegen, pricing and reports all read the one list:

- the op is `aten.linear` and its weight is a trainable 2-D parameter read by linear ops only (a
  weight tied to an embedding is read by `aten.embedding` too: it stays in high precision);
- both weight dims are multiples of 16;
- it is not the output head: the last linear of the forward stays in high precision.

`keep(fqn, weight_shape) -> bool` replaces the default rule (fqn is the module path, the weight's
name without ".weight"); the tied-weight rule holds either way. No torch imports (solver layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.graph import OpGraph
from cost_model.fp8 import RUNTIME_HANDLINGS

FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao's Float8LinearRecipeName values autopar runs: one scale per tensor (dynamic, the
default) or one per row (axiswise scales, e4m3 everywhere)."""

FP8_CASTS = RUNTIME_HANDLINGS
"""How autopar's runtime runs the float8 casts (Plan.fp8_casts): "compiled" (torch.compile,
inductor's fused casts) or "eager" (torchao op by op)."""

LINEAR_TARGET = "aten.linear.default"
FP8_DIM_MULTIPLE = 16


def linear_weights(graph: OpGraph) -> list[tuple[str, str, tuple[int, ...]]]:
    """(linear node, weight FQN, weight shape) of each linear op whose weight is a trainable
    parameter read by linear ops only, in forward order."""
    params = {param.node: param for param in graph.params}
    consumers = graph.consumers
    found = []
    for node in graph.calls():
        if node.target != LINEAR_TARGET or len(node.inputs) < 2:
            continue
        param = params.get(node.inputs[1])
        if param is None or not param.trainable or len(param.meta.shape) != 2:
            continue
        readers = [graph[name] for name in consumers.get(param.node, ()) if graph[name].kind == "call"]
        if any(reader.target != LINEAR_TARGET or reader.inputs[1:2] != (param.node,) for reader in readers):
            continue
        found.append((node.name, param.name, tuple(param.meta.shape)))
    return found


def default_keep(shape: tuple[int, ...]) -> bool:
    return all(size % FP8_DIM_MULTIPLE == 0 for size in shape)


def fp8_linears(graph: OpGraph, keep: Callable[[str, tuple[int, ...]], bool] | None = None) -> tuple[str, ...]:
    """Weight FQNs of the linears that run in float8, sorted (see the module docstring). A weight
    read by several linears (tied) runs in float8 only when every reader qualifies."""
    all_linears = [node for node in graph.calls() if node.target == LINEAR_TARGET]
    head = all_linears[-1].name if all_linears else None
    qualifies: dict[str, bool] = {}
    for node, fqn, shape in linear_weights(graph):
        if keep is not None:
            ok = bool(keep(fqn.removesuffix(".weight"), shape))
        else:
            ok = node != head and default_keep(shape)
        qualifies[fqn] = qualifies.get(fqn, True) and ok
    return tuple(sorted(fqn for fqn, ok in qualifies.items() if ok))


@dataclass(frozen=True, kw_only=True)
class Fp8Choice:
    """What precision "fp8" runs in float8 for one graph."""

    recipe: str = "tensorwise"
    """torchao's scaling recipe (FP8_RECIPES)."""
    linears: tuple[str, ...] = ()
    """Weight FQNs of the linears run in float8 (fp8_linears)."""
    handling: str = "eager"
    """How the casts run (cost_model/fp8.py HANDLINGS): autopar's runtime runs "compiled" (its
    default on GPUs) or "eager" (FP8_CASTS, recorded as Plan.fp8_casts); "torchtitan" and "te"
    price a published run as its framework ran it."""
    auto: bool = False
    """The planner keeps a linear in float8 only where it is priced faster than in bf16 under the
    configuration (fp8_pricing.py); set on devices with FP8 tensor cores when no filter chose."""

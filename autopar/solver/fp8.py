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
name without ".weight"); the tied-weight rule holds either way.

MoE experts (`fp8_experts`): the grouped matmuls of rows sorted by expert (solver/experts.py's
grouped-mm expert ops) run torchao's rowwise FP8 grouped GEMM (codegen/fp8_experts.py), as
torchtitan's Float8GroupedExpertsConverter converts every routed expert layer, when the weight's
matmul dims K and N of [E, K, N] are multiples of 16 (torchao's assertion); `keep` decides for
them too (with the weight's module path and its 3-D shape as the op reads it). Einsum/bmm expert
matmuls (capacity-padded GShard layers) have no torchao float8 path and stay bf16; each expert
weight that stays bf16 gets a note saying why. No torch imports (solver layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.graph import OpGraph
from autopar.solver.experts import find_expert_ops
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


def expert_weights(graph: OpGraph) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(op node, weight FQN, weight shape as the op reads it, kind: "grouped_mm" or "einsum") of
    each expert matmul (solver/experts.py), in graph order."""
    fqns = {param.node: param.name for param in graph.params}
    found = []
    for op in find_expert_ops(graph):
        read = graph[op.weight_views[-1]] if op.weight_views else graph[op.param]
        found.append((op.node, fqns[op.param], tuple(read.output.shape), op.kind))
    return found


def fp8_experts(graph: OpGraph, keep: Callable[[str, tuple[int, ...]], bool] | None = None
                ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(expert weight FQNs whose grouped matmuls run in float8, sorted; (FQN, why) of those that
    stay bf16), see the module docstring. A weight runs in float8 only when every op reading it does."""
    qualifies: dict[str, str] = {}
    for _, fqn, shape, kind in expert_weights(graph):
        if kind != "grouped_mm":
            why = ("an einsum/bmm expert matmul: torchao's float8 grouped GEMM takes grouped matmuls of rows "
                   "sorted by expert")
        elif keep is not None:
            why = "" if keep(fqn.rsplit(".", 1)[0], shape) else "left out by fp8_filter"
        elif not default_keep(shape[1:]):
            why = f"matmul dims {shape[1]} x {shape[2]} are not multiples of {FP8_DIM_MULTIPLE}"
        else:
            why = ""
        qualifies[fqn] = qualifies.get(fqn) or why
    chosen = tuple(sorted(fqn for fqn, why in qualifies.items() if not why))
    return chosen, tuple((fqn, why) for fqn, why in qualifies.items() if why)


@dataclass(frozen=True, kw_only=True)
class Fp8Choice:
    """What precision "fp8" runs in float8 for one graph."""

    recipe: str = "tensorwise"
    """torchao's scaling recipe (FP8_RECIPES)."""
    linears: tuple[str, ...] = ()
    """Weight FQNs of the linears run in float8 (fp8_linears)."""
    experts: tuple[str, ...] = ()
    """Expert weight FQNs whose grouped matmuls run in float8 (fp8_experts)."""
    experts_in_bf16: tuple[tuple[str, str], ...] = ()
    """(FQN, why) of the expert weights whose matmuls stay bf16 (fp8_experts)."""
    handling: str = "eager"
    """How the casts run (cost_model/fp8.py HANDLINGS): autopar's runtime runs "compiled" (its
    default on GPUs) or "eager" (FP8_CASTS, recorded as Plan.fp8_casts); "torchtitan" and "te"
    price a published run as its framework ran it."""
    auto: bool = False
    """The planner keeps a linear in float8 only where it is priced faster than in bf16 under the
    configuration (fp8_pricing.py); set on devices with FP8 tensor cores when no filter chose."""

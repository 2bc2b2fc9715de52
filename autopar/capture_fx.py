"""Fallback capture with `torch.fx.symbolic_trace` and shape propagation.

Used when `torch.export` cannot trace a model. The fx graph holds module calls and torch
functions rather than aten ops; common ones are mapped to their aten equivalents (so that the
sharding strategies apply) and everything else keeps its own name (replicated by the solver).
Shapes come from running the graph on meta tensors at two batch sizes, which also tells which
dimensions follow the batch.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from autopar.blocks import find_blocks_and_segments
from autopar.errors import CaptureError
from autopar.graph import OpGraph, OpNode, ParamInfo, Ref, TensorMeta
from autopar.probe import InputSpec, io_priced, probe_op

_MODULE_TARGETS = {
    nn.Linear: "aten.linear.default", nn.Embedding: "aten.embedding.default",
    nn.LayerNorm: "aten.layer_norm.default", nn.Dropout: "aten.dropout.default", nn.GELU: "aten.gelu.default",
    nn.ReLU: "aten.relu.default", nn.SiLU: "aten.silu.default", nn.Tanh: "aten.tanh.default",
    nn.Conv2d: "aten.conv2d.default", nn.Softmax: "aten.softmax.int", nn.Identity: "aten.alias.default",
}
_FUNCTION_TARGETS = {
    operator.add: "aten.add.Tensor", torch.add: "aten.add.Tensor", operator.mul: "aten.mul.Tensor",
    torch.mul: "aten.mul.Tensor", operator.sub: "aten.sub.Tensor", operator.truediv: "aten.div.Tensor",
    operator.matmul: "aten.matmul.default", torch.matmul: "aten.matmul.default", torch.bmm: "aten.bmm.default",
    F.gelu: "aten.gelu.default", F.relu: "aten.relu.default", torch.relu: "aten.relu.default",
    F.silu: "aten.silu.default", torch.tanh: "aten.tanh.default", F.softmax: "aten.softmax.int",
    torch.softmax: "aten.softmax.int", F.dropout: "aten.dropout.default", F.linear: "aten.linear.default",
    F.layer_norm: "aten.layer_norm.default", torch.cat: "aten.cat.default", F.embedding: "aten.embedding.default",
    F.cross_entropy: "aten.cross_entropy_loss.default", F.mse_loss: "aten.mse_loss.default",
    operator.getitem: "getitem",
}
_METHOD_TARGETS = {
    "view": "aten.view.default", "reshape": "aten.reshape.default", "transpose": "aten.transpose.int",
    "permute": "aten.permute.default", "contiguous": "aten.clone.default", "softmax": "aten.softmax.int",
    "flatten": "aten.flatten.using_ints", "unsqueeze": "aten.unsqueeze.default", "mean": "aten.mean.dim",
    "sum": "aten.sum.dim_IntList", "split": "aten.split.Tensor", "chunk": "aten.chunk.default",
}


def capture_with_fx(module: nn.Module, model: nn.Module, prefix: str, inputs: tuple, kwargs: dict, batch: int,
                    name: str) -> OpGraph:
    if kwargs:
        raise CaptureError("keyword inputs are not supported by the symbolic_trace fallback")
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as error:  # noqa: BLE001
        raise CaptureError(f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}") from None
    metas = _propagate(traced, inputs)
    more_metas = _propagate(traced, _grow_batch(inputs, batch)) if batch else metas
    nodes = _FxConverter(traced, metas, more_metas, prefix).convert()
    blocks, segments = find_blocks_and_segments(model, nodes)
    params = tuple(ParamInfo(name=node.target, node=node.name, meta=node.output, trainable=node.kind == "param")
                   for node in nodes if node.kind in ("param", "buffer"))
    return OpGraph(nodes=tuple(nodes), params=params, blocks=blocks, segments=segments, batch_size=batch,
                   batch_dynamic=batch > 0 and metas is not more_metas, capture_method="symbolic_trace",
                   model_name=name, notes=("captured with torch.fx.symbolic_trace: unmapped ops are replicated",))


def _propagate(traced: torch.fx.GraphModule, inputs: tuple) -> dict[str, Any]:
    try:
        ShapeProp(traced).propagate(*inputs)
    except Exception as error:  # noqa: BLE001
        raise CaptureError(f"shape propagation failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}") from None
    return {node.name: node.meta.get("tensor_meta") for node in traced.graph.nodes}


def _grow_batch(inputs: tuple, batch: int) -> tuple:
    return tuple(torch.cat([value, value[:1]]) if isinstance(value, torch.Tensor) and value.dim() > 0
                 and value.shape[0] == batch else value for value in inputs)


def _meta(value, grown) -> TensorMeta | None:
    if value is None or not hasattr(value, "shape"):
        return None
    coefs = tuple(b - a for a, b in zip(value.shape, grown.shape)) if grown is not None and hasattr(grown, "shape") else ()
    return TensorMeta(shape=tuple(value.shape), dtype=str(value.dtype).removeprefix("torch."),
                      batch_coef=coefs if any(coefs) else ())


class _FxConverter:
    def __init__(self, traced, metas, more_metas, prefix: str) -> None:
        self.traced = traced
        self.metas = metas
        self.more_metas = more_metas
        self.prefix = prefix
        self.nodes: list[OpNode] = []
        self.grad: dict[str, bool] = {}
        self.meta_of: dict[str, TensorMeta] = {}
        self.param_nodes: dict[str, str] = {}
        self.kind_of: dict[str, str] = {}

    def convert(self) -> list[OpNode]:
        for fx_node in self.traced.graph.nodes:
            meta = _meta(self.metas.get(fx_node.name), self.more_metas.get(fx_node.name))
            if fx_node.op == "placeholder" and meta:
                self._add(OpNode(name=fx_node.name, kind="input", target=fx_node.name, outputs=(meta,)), False)
            elif fx_node.op == "get_attr":
                self._attribute(fx_node.name, fx_node.target)
            elif fx_node.op in ("call_module", "call_function", "call_method") and meta:
                self._call(fx_node, meta)
            elif fx_node.op == "output":
                inputs = tuple(n.name for n in fx_node.all_input_nodes if n.name in self.grad)
                self.nodes.append(OpNode(name="output", kind="output", target="output", inputs=inputs))
        return self.nodes

    def _add(self, node: OpNode, requires_grad: bool) -> None:
        self.grad[node.name] = requires_grad
        self.kind_of[node.name] = node.kind
        if node.outputs:
            self.meta_of[node.name] = node.outputs[0]
        self.nodes.append(node)

    def _attribute(self, name: str, target: str) -> str:
        fqn = target.removeprefix(self.prefix)
        if fqn in self.param_nodes:
            return self.param_nodes[fqn]
        tensor = self.traced.get_parameter(target) if _is_param(self.traced, target) else self.traced.get_buffer(target)
        kind = "param" if isinstance(tensor, nn.Parameter) else "buffer"
        trainable = kind == "param" and tensor.requires_grad
        meta = TensorMeta(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
        node_name = name if name not in self.grad else f"p_{fqn.replace('.', '_')}"
        self._add(OpNode(name=node_name, kind=kind, target=fqn, outputs=(meta,), requires_grad=trainable), trainable)
        self.param_nodes[fqn] = node_name
        return node_name

    def _call(self, fx_node, meta: TensorMeta) -> None:
        inputs: list[str] = []

        def to_ref(item):
            if isinstance(item, torch.fx.Node) and item.name in self.grad:
                inputs.append(item.name)
                return Ref(index=len(inputs) - 1)
            return item

        args = list(torch.fx.node.map_aggregate(fx_node.args, to_ref))
        target, callable_ = self._target(fx_node, args, inputs)
        kwargs = dict(torch.fx.node.map_aggregate(dict(fx_node.kwargs), to_ref))
        specs = tuple(self._spec(name) for name in inputs)
        try:
            result = probe_op(callable_, tuple(args), kwargs, specs)
        except Exception as error:  # noqa: BLE001 - priced by its input/output bytes instead
            result = io_priced(target, specs, meta.nbytes, error)
        module_path = fx_node.target if fx_node.op == "call_module" else _module_of(fx_node)
        node = OpNode(name=fx_node.name, kind="call", target=target, inputs=tuple(inputs), args=tuple(args),
                      kwargs=tuple(kwargs.items()), outputs=(meta,), module_path=module_path.removeprefix(self.prefix),
                      fwd_kernels=result.fwd_kernels, bwd_kernels=result.bwd_kernels,
                      saved_inputs=result.saved_inputs, saved_output=result.saved_output,
                      saved_extra_bytes=result.saved_extra_bytes, alias_input=result.alias_input,
                      requires_grad=result.requires_grad)
        self._add(node, result.requires_grad)

    def _target(self, fx_node, args: list, inputs: list[str]):
        """The aten-equivalent name and a callable running the op (parameters become inputs)."""
        if fx_node.op == "call_module":
            submodule = self.traced.get_submodule(fx_node.target)
            param_names = [name for name, _ in submodule.named_parameters()]
            num_call_args = len(args)
            for name in param_names:
                inputs.append(self._attribute(f"{fx_node.target}.{name}", f"{fx_node.target}.{name}"))
                args.append(Ref(index=len(inputs) - 1))

            def call(*call_args, **call_kwargs):
                params = dict(zip(param_names, call_args[num_call_args:]))
                return torch.func.functional_call(submodule, params, call_args[:num_call_args], call_kwargs)

            return _MODULE_TARGETS.get(type(submodule), f"module:{type(submodule).__name__}"), call
        if fx_node.op == "call_method":
            method = fx_node.target
            return _METHOD_TARGETS.get(method, f"method:{method}"), lambda self_, *a, **k: getattr(self_, method)(*a, **k)
        target = fx_node.target
        return _FUNCTION_TARGETS.get(target, getattr(target, "__name__", str(target))), target

    def _spec(self, name: str) -> InputSpec:
        meta = self.meta_of[name]
        stride, running = [], 1
        for size in reversed(meta.shape):
            stride.insert(0, running)
            running *= max(size, 1)
        return InputSpec(shape=meta.shape, stride=tuple(stride), dtype=getattr(torch, meta.dtype),
                         requires_grad=self.grad[name], is_param=self.kind_of[name] in ("param", "buffer"))


def _is_param(module: nn.Module, target: str) -> bool:
    try:
        module.get_parameter(target)
        return True
    except AttributeError:
        return False


def _module_of(fx_node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""

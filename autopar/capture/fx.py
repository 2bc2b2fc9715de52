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

from autopar.capture.activation_saves import fold_activation_saves
from autopar.capture.blocks import find_blocks_and_segments
from autopar.capture.failures import failure_reason, quiet_torch_logs
from autopar.capture.wrap import LOSS_MODULE_PATH, WithLoss
from autopar.errors import CaptureError
from autopar.graph import OpGraph, OpNode, ParamInfo, Ref, TensorMeta
from autopar.capture.probe import InputSpec, io_priced, probe_op

_MODULE_TARGETS = {
    nn.Linear: "aten.linear.default", nn.Embedding: "aten.embedding.default",
    nn.LayerNorm: "aten.layer_norm.default", nn.Dropout: "aten.dropout.default", nn.GELU: "aten.gelu.default",
    nn.ReLU: "aten.relu.default", nn.SiLU: "aten.silu.default", nn.Tanh: "aten.tanh.default",
    nn.Conv2d: "aten.conv2d.default", nn.Softmax: "aten.softmax.int", nn.Identity: "aten.alias.default",
    nn.MSELoss: "aten.mse_loss.default", nn.CrossEntropyLoss: "aten.cross_entropy_loss.default",
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
    if isinstance(module, WithLoss):
        module = _with_named_inputs(module, len(inputs))
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as error:  # noqa: BLE001
        raise CaptureError(failure_reason(error, model)) from None
    metas = _propagate(traced, inputs)
    more_metas = _propagate(traced, _grow_batch(inputs, batch)) if batch else metas
    nodes = _FxConverter(traced, metas, more_metas, prefix).convert()
    blocks, segments = find_blocks_and_segments(model, nodes)
    params = tuple(ParamInfo(name=node.target, node=node.name, meta=node.output, trainable=node.kind == "param")
                   for node in nodes if node.kind in ("param", "buffer"))
    return OpGraph(nodes=tuple(fold_activation_saves(nodes)), params=params, blocks=blocks, segments=segments, batch_size=batch,
                   batch_dynamic=batch > 0 and metas is not more_metas, capture_method="symbolic_trace",
                   model_name=name, notes=("captured with torch.fx.symbolic_trace: unmapped ops are replicated",
                                           *dict.fromkeys(f"{n.target}: {n.note}" for n in nodes if n.note)))


def _with_named_inputs(module: WithLoss, num_inputs: int) -> WithLoss:
    """symbolic_trace cannot unpack WithLoss's `*inputs_and_targets` (a Proxy is not iterable):
    the same model and loss behind a forward with one named argument per input."""
    keywords = module.keyword_names
    if not all(keyword.isidentifier() for keyword in keywords):
        raise CaptureError(f"keyword inputs {keywords} are not all Python identifiers")
    names = [f"input_{index}" for index in range(num_inputs - 1)]
    positional = names[:len(names) - len(keywords)]
    call = ", ".join(positional + [f"{keyword}={name}" for keyword, name in zip(keywords, names[len(positional):])])
    source = (f"def forward(self, {''.join(name + ', ' for name in names)}targets):\n"
              f"    return self.loss_fn(self.model({call}), targets)\n")
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - generated from the fixed template above
    traceable = type("WithLoss", (WithLoss,), {"forward": namespace["forward"]})
    return traceable(module.model, module.loss_fn, keywords)


def _propagate(traced: torch.fx.GraphModule, inputs: tuple) -> dict[str, Any]:

    try:
        with quiet_torch_logs():  # ShapeProp prints the whole traceback of a failing node to stderr
            ShapeProp(traced).propagate(*inputs)
    except Exception as error:  # noqa: BLE001
        cause = error.__cause__ or error.__context__ or error  # ShapeProp wraps the op's own error
        raise CaptureError(f"shape propagation failed: {failure_reason(cause, traced)}") from None
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
        self.alias: dict[str, str] = {}  # get_attr node -> the param/buffer node it reads
        self.node_of_tensor: dict[int, str] = {}  # tied parameters (two names, one tensor) share a node

    def convert(self) -> list[OpNode]:
        placeholders = [fx_node.name for fx_node in self.traced.graph.nodes if fx_node.op == "placeholder"]
        targets = placeholders[-1] if self.prefix and placeholders else None  # WithLoss: the loss targets
        for fx_node in self.traced.graph.nodes:
            meta = _meta(self.metas.get(fx_node.name), self.more_metas.get(fx_node.name))
            if fx_node.op == "placeholder" and meta:
                kind = "target" if fx_node.name == targets else "input"
                self._add(OpNode(name=fx_node.name, kind=kind, target=fx_node.name, outputs=(meta,)), False)
            elif fx_node.op == "get_attr":
                self.alias[fx_node.name] = self._attribute(fx_node.name, fx_node.target)
            elif fx_node.op in ("call_module", "call_function", "call_method") and meta:
                self._call(fx_node, meta)
            elif fx_node.op == "output":
                names = (self.alias.get(n.name, n.name) for n in fx_node.all_input_nodes)
                inputs = tuple(name for name in names if name in self.grad)
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
        tensor = _attribute_tensor(self.traced, target)
        if id(tensor) in self.node_of_tensor:
            self.param_nodes[fqn] = self.node_of_tensor[id(tensor)]
            return self.param_nodes[fqn]
        is_buffer = _is_buffer(self.traced, target)
        kind = "param" if isinstance(tensor, nn.Parameter) else "buffer" if is_buffer else "constant"
        trainable = kind == "param" and tensor.requires_grad
        meta = TensorMeta(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
        node_name = name if name not in self.grad else f"p_{fqn.replace('.', '_')}"
        self._add(OpNode(name=node_name, kind=kind, target=fqn, outputs=(meta,), requires_grad=trainable), trainable)
        self.param_nodes[fqn] = self.node_of_tensor[id(tensor)] = node_name
        return node_name

    def _call(self, fx_node, meta: TensorMeta) -> None:
        inputs: list[str] = []

        def to_ref(item):
            name = self.alias.get(item.name, item.name) if isinstance(item, torch.fx.Node) else None
            if name in self.grad:
                inputs.append(name)
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
        if self.prefix and module_path == self.prefix.rstrip("."):
            module_path = ""  # the wrapped model's root
        elif self.prefix and not module_path.startswith(self.prefix):
            module_path = LOSS_MODULE_PATH  # ran in WithLoss.forward: part of loss_fn
        node = OpNode(name=fx_node.name, kind="call", target=target, inputs=tuple(inputs), args=tuple(args),
                      kwargs=tuple(kwargs.items()), outputs=(meta,), module_path=module_path.removeprefix(self.prefix),
                      **result.node_fields())
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


def _attribute_tensor(module: nn.Module, target: str) -> torch.Tensor:
    """A parameter, buffer or plain tensor attribute (a constant) by dotted path."""
    owner_path, _, attribute = target.rpartition(".")
    return getattr(module.get_submodule(owner_path), attribute)


def _is_buffer(module: nn.Module, target: str) -> bool:
    try:
        module.get_buffer(target)
        return True
    except AttributeError:
        return False


def _module_of(fx_node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""

"""Model -> OpGraph.

`capture` traces the model with `torch.export` (non-strict) on fake tensors, with the batch
dimension symbolic so that the graph can be priced at any microbatch size. A model whose
parameters live on the `meta` device is captured without allocating them. If export fails
with a dynamic batch it is retried with a static one, then with `torch.fx.symbolic_trace` and
shape propagation (fx.py); if all fail, `CaptureError` names the failing module and
the reasons.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.export import Dim, export

from autopar.capture.blocks import find_blocks_and_segments
from autopar.capture.canonical_order import canonicalize
from autopar.errors import CaptureError
from autopar.graph import OpGraph, OpNode, ParamInfo, Ref, TensorMeta
from autopar.capture.activation_saves import fold_activation_saves
from autopar.capture.gradient_layouts import with_gradient_layouts
from autopar.capture.gradient_sums import with_gradient_sums
from autopar.capture.failures import (DATA_DEPENDENT_ADVICE, failing_location, failure_reason, is_data_dependent,
                                      is_data_dependent_text, quiet_torch_logs, reads_values)
from autopar.capture.fx import capture_with_fx
from autopar.capture.probe import InputSpec, ProbeResult, io_priced, probe_op
from autopar.capture.wrap import LOSS_MODULE_PATH, LOSS_WRAPPER_PREFIX, WithLoss

def capture(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None, *,
            loss_fn: Callable | None = None, example_targets: Any = None, dynamic_batch: bool = True,
            name: str = "", verbose: bool = False) -> OpGraph:
    """Trace `model(*example_inputs, **example_kwargs)` (plus `loss_fn(out, targets)` if given)."""
    return capture_program(model, example_inputs, example_kwargs, loss_fn=loss_fn, example_targets=example_targets,
                           dynamic_batch=dynamic_batch, name=name, verbose=verbose)[1]


def capture_program(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None, *,
                    loss_fn: Callable | None = None, example_targets: Any = None, dynamic_batch: bool = True,
                    name: str = "", verbose: bool = False, allow_fallback: bool = True,
                    gradient_sums: bool = True):
    """Like `capture`, also returning the ExportedProgram (None after the fx fallback), which
    codegen runs. The model is traced in training mode (dropout and friends included).
    `gradient_sums=False` leaves out autograd's sums of gradients (gradient_sums.py), for a
    partial capture that is completed first."""
    was_training = model.training
    model.train()
    try:  # grad mode as the caller had it, whatever an op run while capturing leaves it in
        with without_kv_cache(model), torch.set_grad_enabled(torch.is_grad_enabled()):
            program, graph = _capture(model, example_inputs, example_kwargs, loss_fn, example_targets, dynamic_batch,
                                      name, verbose, allow_fallback)
    finally:
        model.train(was_training)
    return program, (with_gradient_sums(graph) if gradient_sums else graph)


@contextlib.contextmanager
def without_kv_cache(model: nn.Module):
    """Hugging Face models return a key/value cache when `config.use_cache` is set, as their configs
    do by default: an inference feature that a training step never reads, whose cache object
    torch.export cannot return (and a pipeline would have to ship from every stage to the loss).
    The capture, which is what autopar runs, is traced with it off on every config the model's
    modules hold (T5's decoder stack keeps a copy of its own), as Hugging Face's Trainer does under
    gradient checkpointing; the configs are left as they were. An explicit `use_cache=` input
    still wins."""
    configs = {id(config): config for module in model.modules()
               if getattr(config := getattr(module, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _capture(model, example_inputs, example_kwargs, loss_fn, example_targets, dynamic_batch, name, verbose,
             allow_fallback):
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    module, prefix = model, ""
    if loss_fn is not None:
        if example_targets is None:
            raise CaptureError("capture: loss_fn was given without example_targets; pass both or neither")
        module, prefix = WithLoss(model, loss_fn, keyword_names=tuple(kwargs)), LOSS_WRAPPER_PREFIX
        inputs, kwargs = inputs + tuple(kwargs.values()) + (example_targets,), {}
    inputs, kwargs = _inputs_on_model_device(model, inputs, kwargs)
    batch = _batch_size(inputs, kwargs)
    log = _logger(verbose)
    failures: list[str] = []
    for dynamic in (True, False) if dynamic_batch and batch else (False,):
        started = time.perf_counter()
        try:
            log(f"capture: torch.export ({'dynamic' if dynamic else 'static'} batch)...")
            with quiet_torch_logs():
                program = _export(module, inputs, kwargs, batch if dynamic else None)
            canonicalize(program, prefix)
        except Exception as error:  # noqa: BLE001 - any tracing failure falls through to the next method
            method_name = f"torch.export ({'dynamic' if dynamic else 'static'} batch)"
            failures.append(f"{method_name}: {failure_reason(error, model)}")
            continue
        log(f"capture: traced {len(program.graph.nodes)} nodes in {time.perf_counter() - started:.1f}s; probing ops...")
        converter = ExportConverter(program, model, prefix, batch or 1, dynamic, name)
        try:
            graph = converter.convert()
        except Exception as error:  # noqa: BLE001 - only a data-dependent shape is the user's to fix
            if not is_data_dependent(error):
                raise
            raise CaptureError(f"could not capture {name or type(model).__name__}:\n  - converting the exported "
                               f"graph{converter.where()}: {failure_reason(error, model)}\n"
                               f"{DATA_DEPENDENT_ADVICE}") from None
        log(f"capture: done in {time.perf_counter() - started:.1f}s")
        return program, graph
    if not allow_fallback:
        raise CaptureError(f"could not export {name or type(model).__name__}:\n  - " + "\n  - ".join(failures))
    try:
        log("capture: torch.fx.symbolic_trace fallback...")
        return None, capture_with_fx(module, model, prefix, inputs, kwargs, batch or 1, name)
    except CaptureError as error:
        failures.append(f"torch.fx.symbolic_trace: {error}")
    except Exception as error:  # noqa: BLE001
        failures.append(f"torch.fx.symbolic_trace: {failure_reason(error, model)}")
    model_name = name or type(model).__name__
    eager_error = _eager_failure(module, model, inputs, kwargs)
    if eager_error is not None and not is_data_dependent(eager_error):
        shapes = ", ".join(str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
                           for value in inputs)
        raise CaptureError(f"{model_name} rejects its example inputs: running model(*example_inputs) itself fails, "
                           f"before any tracing, with {failure_reason(eager_error, model)}. The inputs (and "
                           f"targets) have shapes {shapes}: give example_inputs of the shapes and dtypes the "
                           "model takes (and example_targets the loss takes)")
    data_dependent = eager_error is not None or any(is_data_dependent_text(failure) for failure in failures)
    if not data_dependent:
        raise CaptureError(f"could not capture {model_name}:\n  - " + "\n  - ".join(failures) + "\nMake the forward "
                           "pass traceable (no data-dependent Python control flow, no .item()/.tolist(), no printing "
                           "of tensor values) or capture a simpler model.")
    # Where the eager run (on meta) first read a value, unless a tracer already named the data-dependent
    # line: on meta the first read may be harmless code (a mask check) that real tensors pass.
    traced_there = any(is_data_dependent_text(failure) for failure in failures)
    where = failing_location(eager_error, model) if eager_error is not None and reads_values(eager_error) \
        and not traced_there else ""
    raise CaptureError(f"could not capture {model_name}: its forward reads tensor values"
                       + (f" ({where})" if where else "") + ":\n  - "
                       + "\n  - ".join(failures) + "\n" + DATA_DEPENDENT_ADVICE)


def _eager_failure(module: nn.Module, model: nn.Module, inputs: tuple, kwargs: dict) -> BaseException | None:
    """The error of running the (wrapped) model once on its example inputs, or None if it runs:
    tells inputs the model rejects apart from code that only tracing cannot follow."""
    try:
        with torch.no_grad(), quiet_torch_logs():
            module(*inputs, **kwargs)
    except NotImplementedError as error:
        return None if "meta" in str(error).lower() and not is_data_dependent(error) else error
    except Exception as error:  # noqa: BLE001 - reported by the caller
        return error
    return None


def targets_like_output(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None):
    """Stand-in targets for a loss given without example targets: zeros (meta) shaped like the
    model's output, or like its first tensor when it returns a tuple or a ModelOutput.

    The shape comes from tracing the model (no compute, no ops probed): running it on meta
    instead fails on a `.item()` or other data-dependent step that export traces symbolically.
    A loss that wants class indices needs real example targets."""
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    inputs, kwargs = _inputs_on_model_device(model, inputs, kwargs)
    try:
        with quiet_torch_logs():
            program = _export(model, inputs, kwargs, None)
    except Exception as error:  # noqa: BLE001 - reported as the missing targets
        raise CaptureError(f"loss_fn was given without example_targets, and the model could not be traced to "
                           f"learn its output's shape ({failure_reason(error, model)}); pass example_targets") from None
    output = next(node for node in program.graph.nodes if node.op == "output")
    values = [value.meta.get("val") for value in _flat_nodes(output.args)]
    first = next((value for value in values if isinstance(value, torch.Tensor)), None)
    if first is None:
        raise CaptureError("loss_fn was given without example_targets, and the model returns no tensor to shape "
                           "them like: pass example_targets")
    shape = [_size_hint(size, None)[0] for size in first.shape]
    return torch.zeros(shape, dtype=first.dtype, device="meta")


def _logger(verbose: bool) -> Callable[[str], None]:
    return (lambda message: print(message, file=sys.stderr, flush=True)) if verbose else (lambda message: None)


def _inputs_on_model_device(model: nn.Module, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Meta models get meta inputs (values do not matter for tracing)."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "meta":
        return inputs, kwargs
    move = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    return tuple(move(value) for value in inputs), {key: move(value) for key, value in kwargs.items()}


def _batch_size(inputs: tuple, kwargs: dict) -> int | None:
    for value in list(inputs) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _export(module: nn.Module, inputs: tuple, kwargs: dict, batch: int | None):
    if batch is None:
        return export(module, inputs, kwargs, strict=False)
    if batch < 2:  # export specializes sizes 0 and 1: trace at 2, the batch stays symbolic
        inputs = _repeat_batch(inputs, batch)
        kwargs = dict(zip(kwargs, _repeat_batch(tuple(kwargs.values()), batch)))
        batch = 2
    batch_dim = Dim("batch")

    def spec(value):
        if isinstance(value, torch.Tensor):
            return {0: batch_dim} if value.dim() > 0 and value.shape[0] == batch else None
        if isinstance(value, (tuple, list)):
            return type(value)(spec(item) for item in value)
        if isinstance(value, dict):
            return {key: spec(item) for key, item in value.items()}
        return None

    bound = inspect.signature(module.forward).bind(*inputs, **kwargs)
    dynamic_shapes = {name: spec(value) for name, value in bound.arguments.items()}
    try:
        return export(module, inputs, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except torch._dynamo.exc.UserError as error:
        if error.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
            raise
    # A guard on the batch that torch cannot prove for every size (Llama 4's chunked attention:
    # 32*B*min(64, 2048*B) == 2048*B, true for all B >= 1) becomes an assertion in the graph; it is
    # kept only if it holds at every batch size the planner may give a replica, else the batch is fixed.
    program = export(module, inputs, kwargs, strict=False, dynamic_shapes=dynamic_shapes,
                     prefer_deferred_runtime_asserts_over_guards=True)
    failing = _failing_batch_assertion(program)
    if failing is not None:
        raise ValueError(f"the batch is fixed by the model: {failing}")
    return program


CHECKED_BATCH_SIZES = tuple(range(1, 65)) + tuple(2**k for k in range(7, 21))
"""Batch sizes at which a deferred assertion on the batch must hold for the capture to keep the batch
symbolic: every size up to 64 and the powers of two to 2^20 (a replica's microbatch)."""


def _failing_batch_assertion(program) -> str | None:
    """The first assertion of the exported graph on one symbol (the batch) that is false at one of
    CHECKED_BATCH_SIZES, or that reads anything else, as text; None if all hold."""
    for node in program.graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default:
            continue
        value = getattr(node.args[0], "meta", {}).get("val")
        expr = getattr(getattr(value, "node", None), "expr", None)
        symbols = getattr(expr, "free_symbols", None)
        if expr is None or len(symbols) != 1:
            return f"{node.args[1] if len(node.args) > 1 else node.name} (not an assertion on the batch alone)"
        (symbol,) = symbols
        for size in CHECKED_BATCH_SIZES:
            if not bool(expr.subs(symbol, size)):
                return f"{expr} is false at batch {size}"
    return None


def _repeat_batch(values: tuple, batch: int) -> tuple:
    return tuple(torch.cat([value] * 2) if isinstance(value, torch.Tensor) and value.dim() > 0
                 and value.shape[0] == batch else value for value in values)


# --- ExportedProgram -> OpGraph ----------------------------------------------------------------

def tensor_meta(value: torch.Tensor, batch_symbol=None) -> TensorMeta:
    shape, coefs = [], []
    for size in value.shape:
        hint, coef = _size_hint(size, batch_symbol)
        shape.append(hint)
        coefs.append(coef)
    return TensorMeta(shape=tuple(shape), dtype=str(value.dtype).removeprefix("torch."),
                      batch_coef=tuple(coefs) if any(coefs) else ())


def _size_hint(size, batch_symbol) -> tuple[int, int]:
    if isinstance(size, int):
        return size, 0
    node = size.node
    hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
    coef = _batch_coef(node.expr, batch_symbol) if batch_symbol is not None else 0
    return int(hint), coef


@functools.lru_cache(maxsize=4096)
def _batch_coef(expr, batch_symbol) -> int:
    """d size / d batch for an affine size (cached: a 96-layer graph repeats a few expressions)."""
    if batch_symbol not in expr.free_symbols:
        return 0
    derivative = expr.diff(batch_symbol)
    return int(derivative) if derivative.is_number else 0


def concrete(value):
    """SymInts become their example values; torch dtypes/devices become strings."""
    if isinstance(value, torch.SymInt):
        return _size_hint(value, None)[0]
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return value.node.hint
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return type(value)(concrete(item) for item in value)
    if isinstance(value, dict):
        return {key: concrete(item) for key, item in value.items()}
    return value


def _probe_value(value):
    """Like `concrete` but for running the op: dtypes stay torch dtypes (`aten.to.dtype` needs one)
    and devices become meta, so that a factory op of a CPU/GPU model allocates nothing."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return concrete(value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_probe_value(item) for item in value)
    if isinstance(value, dict):
        return {key: _probe_value(item) for key, item in value.items()}
    return value


def _hint_nbytes(value: torch.Tensor) -> int:
    """Bytes at the example sizes. Arithmetic on a symbolic size (`t.numel()`) would add a guard
    that specializes the batch symbol for every later node."""
    return math.prod(_size_hint(size, None)[0] for size in value.shape) * value.element_size()


class ExportConverter:
    """Walks an ExportedProgram's graph, probes each op and builds the OpGraph."""

    def __init__(self, program, model: nn.Module, prefix: str, batch: int, dynamic: bool, name: str) -> None:
        self.program = program
        self.model = model
        self.prefix = prefix
        self.batch = 2 if dynamic and batch < 2 else batch
        self.dynamic = dynamic
        self.name = name
        self.nodes: list[OpNode] = []
        self.params: list[ParamInfo] = []
        self.requires_grad: dict[str, bool] = {}
        self.placeholder_kind: dict[str, tuple[str, str]] = {}
        self.tied: dict[str, str] = {}  # placeholder of a tied parameter's second name -> the first
        # Output strides from the probe (CUDA kernels' layouts). Export's own come from the capture
        # device's kernels: on CPU, SDPA returns a (batch, seq, heads, dim) layout and on meta a
        # contiguous one, which decides whether a later transpose + flatten is a view or a copy.
        self.strides: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.probe_cache: dict[Any, ProbeResult] = {}
        self.probed: dict[str, tuple] = {}
        """Call node name -> (fx node, args, kwargs, tensor inputs) it was probed with."""
        self.results: dict[str, ProbeResult] = {}
        self.notes: list[str] = []
        self.batch_symbol = None

    def convert(self) -> OpGraph:
        self._read_signature()
        for fx_node in self.program.graph.nodes:
            self.converting = fx_node
            self._convert_node(fx_node)
        self.nodes = with_gradient_layouts(self.nodes, self.results, self._reprobe)
        blocks, segments = find_blocks_and_segments(self.model, self.nodes)
        batch_dynamic = self.dynamic and self.batch_symbol is not None
        return OpGraph(nodes=tuple(fold_activation_saves(self.nodes)), params=tuple(self.params), blocks=blocks, segments=segments,
                       batch_size=self.batch, batch_dynamic=batch_dynamic, capture_method="export",
                       model_name=self.name, notes=tuple(dict.fromkeys(self.notes)))

    def _read_signature(self) -> None:
        from torch.export.graph_signature import InputKind

        kinds = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.USER_INPUT: "input",
                 InputKind.CONSTANT_TENSOR: "constant"}
        # torch.export lifts a tied parameter once per name (GPT-2's lm_head.weight and
        # transformer.wte.weight): keep the first placeholder, point the others at it.
        first_of_tensor: dict[int, str] = {}
        for spec in self.program.graph_signature.input_specs:
            kind = kinds.get(spec.kind, "constant")
            target = (spec.target or spec.arg.name).removeprefix(self.prefix)
            self.placeholder_kind[spec.arg.name] = (kind, target)
            tensor = self.program.state_dict.get(spec.target) if kind in ("param", "buffer") else None
            if tensor is not None:
                self.tied[spec.arg.name] = first_of_tensor.setdefault(id(tensor), spec.arg.name)
        self.tied = {name: first for name, first in self.tied.items() if name != first}
        user_inputs = [spec.arg.name for spec in self.program.graph_signature.input_specs
                       if spec.kind == InputKind.USER_INPUT]
        if self.prefix and user_inputs:  # WithLoss: the last input holds the targets of the loss
            self.placeholder_kind[user_inputs[-1]] = ("target", user_inputs[-1])
        for fx_node in self.program.graph.nodes:
            if fx_node.op == "placeholder" and self.placeholder_kind.get(fx_node.name, ("",))[0] == "input":
                value = fx_node.meta.get("val")
                if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(value.shape[0], torch.SymInt):
                    self.batch_symbol = value.shape[0].node.expr
                    return

    def _convert_node(self, fx_node) -> None:
        value = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            self._placeholder(fx_node, value)
        elif fx_node.op == "call_function":
            if _tensor_list(value) is None:
                return  # symbolic-size arithmetic: folded into the consumers' arguments
            self._call(fx_node, value)
        elif fx_node.op == "output":
            refs = [arg for arg in _flat_nodes(fx_node.args) if arg.name in self.requires_grad]
            self.nodes.append(OpNode(name=fx_node.name, kind="output", target="output",
                                     inputs=tuple(self.tied.get(arg.name, arg.name) for arg in refs)))

    def _placeholder(self, fx_node, value) -> None:
        kind, target = self.placeholder_kind.get(fx_node.name, ("input", fx_node.name))
        if not isinstance(value, torch.Tensor):
            return
        trainable = kind == "param" and self._is_trainable(target)
        self.requires_grad[fx_node.name] = trainable
        if fx_node.name in self.tied:
            return
        meta = tensor_meta(value, self.batch_symbol)
        self.nodes.append(OpNode(name=fx_node.name, kind=kind, target=target, outputs=(meta,),
                                 requires_grad=trainable))
        if kind in ("param", "buffer"):
            self.params.append(ParamInfo(name=target, node=fx_node.name, meta=meta, trainable=trainable))

    def _is_trainable(self, target: str) -> bool:
        try:
            return self.model.get_parameter(target).requires_grad
        except AttributeError:
            return True

    def _call(self, fx_node, value) -> None:
        tensor_inputs: list = []

        def to_ref(item):
            if isinstance(item, torch.fx.Node):
                if item.name in self.requires_grad:
                    tensor_inputs.append(item)
                    return Ref(index=len(tensor_inputs) - 1)
                return concrete(item.meta.get("val"))
            return item

        args = torch.fx.node.map_aggregate(fx_node.args, to_ref)
        kwargs = torch.fx.node.map_aggregate(dict(fx_node.kwargs), to_ref)
        outputs = tuple(tensor_meta(tensor, self.batch_symbol) for tensor in _tensor_list(value) if tensor is not None)
        inputs = tuple(self.tied.get(node.name, node.name) for node in tensor_inputs)
        common = dict(name=fx_node.name, kind="call", target=_target_name(fx_node.target), inputs=inputs,
                      args=concrete(args), kwargs=tuple(concrete(dict(kwargs)).items()), outputs=outputs,
                      module_path=self._module_path(fx_node))
        if fx_node.target is operator.getitem:
            grad = self.requires_grad[inputs[0]]
            self.requires_grad[fx_node.name] = grad
            source_strides, index = self.strides.get(inputs[0], ()), fx_node.args[1]
            if isinstance(index, int) and -len(source_strides) <= index < len(source_strides):
                self.strides[fx_node.name] = (source_strides[index],)
            self.nodes.append(OpNode(**common, alias_input=0, requires_grad=grad))
            return
        result = self._probe(fx_node, args, kwargs, tensor_inputs)
        self.probed[fx_node.name], self.results[fx_node.name] = (fx_node, args, kwargs, tensor_inputs), result
        self.requires_grad[fx_node.name] = result.requires_grad
        values, strides = _tensor_list(value), result.output_strides
        if len(strides) == len(values) and all(t is not None and len(s) == t.dim() for t, s in zip(values, strides)):
            self.strides[fx_node.name] = strides
        if result.note:
            self.notes.append(f"{common['target']}: {result.note}")
        self.nodes.append(OpNode(**common, **result.node_fields()))

    def _reprobe(self, name: str, grad_strides: tuple[tuple[int, ...], ...]) -> ProbeResult | None:
        """Node `name`'s probe again, its gradient laid out with `grad_strides` (gradient_layouts.py)."""
        result = self._probe(*self.probed[name], grad_strides=grad_strides)
        return None if result.note else result

    def _probe(self, fx_node, args, kwargs, tensor_inputs, grad_strides=None) -> ProbeResult:
        specs = tuple(self._input_spec(node) for node in tensor_inputs)
        bodies = tuple(arg.target for arg in fx_node.args if _is_submodule(arg))
        key = (fx_node.target, bodies, repr(concrete(args)), repr(sorted(concrete(kwargs).items())), specs,
               grad_strides)
        if key not in self.probe_cache:
            try:
                self.probe_cache[key] = probe_op(fx_node.target, self._with_bodies(fx_node, _probe_value(args)),
                                                 _probe_value(kwargs), specs, grad_strides)
            except Exception as error:  # noqa: BLE001 - an op without a meta kernel is priced by its I/O
                values = _tensor_list(fx_node.meta.get("val")) or []
                out_bytes = sum(_hint_nbytes(t) for t in values if t is not None)
                self.probe_cache[key] = io_priced(_target_name(fx_node.target), specs, out_bytes, error)
        return self.probe_cache[key]

    def _with_bodies(self, fx_node, args):
        """`args` with each submodule argument (the body of a higher-order op: export writes a
        `with torch.no_grad():` region as wrap_with_set_grad_enabled(False, body, *inputs)) the
        graph module it names, so that the probe runs and prices the body."""
        if not isinstance(args, tuple) or len(args) != len(fx_node.args):
            return args
        return tuple(operator.attrgetter(arg.target)(self.program.graph_module) if _is_submodule(arg) else value
                     for arg, value in zip(fx_node.args, args))

    def _input_spec(self, fx_node) -> InputSpec:
        value = fx_node.meta["val"]
        shape = tuple(_size_hint(size, None)[0] for size in value.shape)
        name = self.tied.get(fx_node.name, fx_node.name)
        if name in self.strides:
            stride = self.strides[name][0]
        else:
            stride = tuple(_size_hint(size, None)[0] for size in value.stride())
        kind = self.placeholder_kind.get(fx_node.name, ("call",))[0]
        return InputSpec(shape=shape, stride=stride, dtype=value.dtype, requires_grad=self.requires_grad[fx_node.name],
                         is_param=kind in ("param", "buffer"))

    def _module_path(self, fx_node) -> str:
        return fx_module_path(fx_node, self.prefix)

    def where(self) -> str:
        """ " at op X of module 'Y' (file:line)" for the node being converted, "" before any."""
        fx_node = getattr(self, "converting", None)
        if fx_node is None or fx_node.op != "call_function":
            return ""
        path = self._module_path(fx_node)
        frames = [line.strip() for line in (fx_node.meta.get("stack_trace") or "").splitlines()
                  if line.strip().startswith("File ")]
        line = f" ({frames[-1]})" if frames else ""
        return f" at {_target_name(fx_node.target)} of module '{path or '<root>'}'{line}"


def fx_module_path(fx_node, prefix: str = "") -> str:
    """Dotted path of the innermost model module that ran an exported node ("" for the root)."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.split("@")[0]
    if prefix and (path + ".").startswith(prefix):
        path = path[len(prefix):]
    elif prefix:
        path = LOSS_MODULE_PATH  # ran in WithLoss.forward itself: part of loss_fn
    return path


def _is_submodule(arg) -> bool:
    return isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and arg.meta.get("val") is None


def _tensor_list(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return list(value)
    return None


def _flat_nodes(args) -> list:
    found: list = []
    torch.fx.node.map_aggregate(args, lambda item: found.append(item) if isinstance(item, torch.fx.Node) else None)
    return found


def _target_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    name = str(target)
    return name if name.startswith("aten.") else getattr(target, "__name__", name)

"""OpGraph: the model as aten-level ops with shapes, costs, parameters and block structure.

The graph is plain data (no torch objects), captured once at an example batch size. Every tensor
dimension is an affine function of the batch size (`TensorMeta.batch_coef`), so the planner can
price any microbatch size without capturing again (`OpGraph.with_batch`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

ITEMSIZE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_LAYOUT_ONLY = frozenset({"aten.contiguous.default", "aten.clone.default", "aten.alias.default",
                          "aten.detach.default", "aten.lift_fresh_copy.default"})
_CASTS = frozenset({"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default",
                    "aten.type_as.default"})
"""Dtype (and device) casts: a cast to the dtype a tensor has already returns that tensor (an fp32 model's
`x.to(torch.float32)`), so which node later readers name depends on the dtype the model was traced
in; Graph.fingerprint leaves casts out with the layout-only copies."""
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor at the graph's batch size."""

    shape: tuple[int, ...]
    """Sizes at `OpGraph.batch_size`."""
    dtype: str
    """torch dtype name without the prefix: "float32", "bfloat16", "int64", "bool"."""
    batch_coef: tuple[int, ...] = ()
    """Per dim, how much the size grows per extra sample (0 for fixed dims; empty: all fixed)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize_bytes(self) -> int:
        return ITEMSIZE_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize_bytes

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def batch_dims(self) -> tuple[int, ...]:
        return tuple(dim for dim, coef in enumerate(self.batch_coef) if coef)

    def at_batch(self, old_batch: int, new_batch: int) -> "TensorMeta":
        if not any(self.batch_coef) or old_batch == new_batch:
            return self
        shape = tuple(size + coef * (new_batch - old_batch) for size, coef in zip(self.shape, self.batch_coef))
        return replace(self, shape=shape)


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """One device kernel that an op launches (as counted on meta tensors)."""

    name: str
    """aten overload, e.g. "aten.mm.default"."""
    flops: float
    """Floating-point operations (matmul-class kernels) or elements touched (others)."""
    io_bytes: float
    """Bytes read plus bytes written."""
    is_matmul: bool
    """Runs on tensor cores (mm, bmm, conv, attention); else memory-bound."""
    dtype: str = "float32"
    """dtype of the kernel's first floating-point tensor (sets the peak FLOP/s)."""
    causal: bool = False
    """A fused attention kernel with a causal mask (a measured attention rate prices it)."""
    head_dim: int = 0
    """A fused attention kernel's query head dim (documented rates depend on it); 0 for others."""
    dropout: bool = False
    """A fused attention kernel with dropout: it draws the mask of every score inside the kernel
    (cost_model/attention.py DROPOUT_SLOWDOWN)."""
    broadcast: bool = False
    """A pointwise kernel with an operand broadcast along the output (a [s, s] mask over
    [b, h, s, s] scores, RoPE's [s, d] tables): GPUs run these unvectorized (a measured rate)."""
    expert_bytes: float = 0.0
    """Of io_bytes, a grouped matmul's per-expert operands (its 3-D [experts, K, N] weights and
    weight gradients): expert parallelism divides these among the ranks, not the rows."""


@dataclass(frozen=True, kw_only=True)
class Ref:
    """Placeholder for the k-th tensor input inside `OpNode.args`."""

    index: int


@dataclass(frozen=True, kw_only=True)
class OpNode:
    """One node of the captured program."""

    name: str
    """Unique fx node name."""
    kind: str
    """"input" (user input), "target" (the loss targets), "param", "buffer", "constant", "call" or "output"."""
    target: str = ""
    """aten overload for calls ("aten.linear.default", "getitem"); FQN for params/buffers."""
    inputs: tuple[str, ...] = ()
    """Names of the nodes whose tensors this node reads, in argument order."""
    args: tuple = ()
    """Call arguments with tensors replaced by `Ref(k)` (k indexes `inputs`)."""
    kwargs: tuple[tuple[str, object], ...] = ()
    """Keyword arguments, same convention as args."""
    outputs: tuple[TensorMeta, ...] = ()
    """Output tensors (several for split/topk-like ops)."""
    module_path: str = ""
    """Dotted path of the innermost module that ran this op ("" for the root)."""
    fwd_kernels: tuple[Kernel, ...] = ()
    bwd_kernels: tuple[Kernel, ...] = ()
    saved_inputs: tuple[int, ...] = ()
    """Indices into `inputs` that the backward pass keeps alive."""
    saved_output: bool = False
    """Whether the backward keeps this node's output."""
    recomputed_inputs: tuple[int, ...] = ()
    """Indices into `inputs` that the backward needs but does not keep: each is a gated
    activation's output, run again from the activation's own saved input (activation_saves.py)."""
    saved_extra_bytes: float = 0.0
    """Bytes of new tensors saved for backward (dropout masks, norm statistics)."""
    alias_input: int | None = None
    """The output is a view of this input (no new storage)."""
    requires_grad: bool = False
    """The output depends on trainable parameters."""
    note: str = ""
    """Why the costs are approximate (e.g. op could not run on meta)."""
    dispatches: int = 0
    """aten ops a call dispatches, forward and backward, views and allocations included, as the
    probe counted them: what a tensor subclass such as DTensor handles one by one (0: not counted)."""
    unfused_dispatches: int = 0
    """A fused attention call: the aten ops of torch's math kernel in its place, forward and
    backward, which is how DTensor runs attention on CPU (capture/unfused_attention.py); 0 otherwise."""
    unfused_fwd_kernels: tuple[Kernel, ...] = ()
    """A fused attention call: the kernels of torch's math kernel in its place, forward (empty
    otherwise): what the runtime computes where it takes that path (solver/costing.py)."""
    unfused_bwd_kernels: tuple[Kernel, ...] = ()
    """The same, backward."""

    @property
    def output(self) -> TensorMeta:
        return self.outputs[0]

    @property
    def fwd_flops(self) -> float:
        return sum(kernel.flops for kernel in self.fwd_kernels if kernel.is_matmul)

    @property
    def bwd_flops(self) -> float:
        return sum(kernel.flops for kernel in self.bwd_kernels if kernel.is_matmul)

    @property
    def fwd_io_bytes(self) -> float:
        return sum(kernel.io_bytes for kernel in self.fwd_kernels)

    def kwarg(self, name: str, default=None):
        return dict(self.kwargs).get(name, default)


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """A trainable parameter or buffer and the nodes that use it."""

    name: str
    """Fully-qualified name in the model (the first one for tied parameters)."""
    node: str
    """Placeholder node name."""
    meta: TensorMeta
    trainable: bool
    """False for buffers."""


@dataclass(frozen=True, kw_only=True)
class BlockGroup:
    """Structurally identical blocks (e.g. the 96 layers of GPT-3): solve one, reuse for all."""

    container: str
    """Path of the ModuleList/Sequential, e.g. "layers" or "transformer.h"."""
    instances: tuple[str, ...]
    """Module paths of the identical blocks, in order ("layers.0", "layers.1", ...)."""
    nodes: tuple[tuple[str, ...], ...]
    """Per instance, its call nodes in order; position i is the same op in every instance."""
    signature: str
    """Hash of the template's ops, shapes and parameter shapes."""

    @property
    def template(self) -> tuple[str, ...]:
        return self.nodes[0]

    @property
    def num_instances(self) -> int:
        return len(self.instances)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A contiguous run of call nodes that a pipeline stage boundary may not split."""

    name: str
    """A block's module path ("layers.3"), or "prologue"/"epilogue"/"between:..."."""
    nodes: tuple[str, ...]
    block_group: int | None = None
    """Index into OpGraph.blocks if this segment is one instance of a repeated block."""


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    """The captured model."""

    nodes: tuple[OpNode, ...]
    """Topologically ordered."""
    params: tuple[ParamInfo, ...]
    blocks: tuple[BlockGroup, ...]
    segments: tuple[Segment, ...]
    batch_size: int
    """Batch size the shapes are given at."""
    batch_dynamic: bool
    """Whether shapes follow the batch size (False: captured statically, fixed batch)."""
    capture_method: str
    """"export" or "symbolic_trace"."""
    model_name: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What capture could not do exactly (ops priced approximately, fallbacks)."""
    node_weights: dict[str, int] = field(default_factory=dict)
    """How many identical nodes a node stands for (condensed graphs, see condense.py); default 1."""
    stand_ins: dict[str, str] = field(default_factory=dict)
    """Condensed graphs: each dropped node (and parameter) -> the kept node that stands for it."""

    def weight(self, name: str) -> int:
        return self.node_weights.get(name, 1)

    @cached_property
    def by_name(self) -> dict[str, OpNode]:
        return {node.name: node for node in self.nodes}

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        users: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for source in dict.fromkeys(node.inputs):
                users[source].append(node.name)
        return {name: tuple(names) for name, names in users.items()}

    def __getitem__(self, name: str) -> OpNode:
        return self.by_name[name]

    def calls(self) -> Iterator[OpNode]:
        return (node for node in self.nodes if node.kind == "call")

    @property
    def num_params(self) -> int:
        return sum(param.meta.numel for param in self.params if param.trainable)

    @property
    def param_bytes(self) -> int:
        return sum(param.meta.nbytes for param in self.params if param.trainable)

    @property
    def fwd_flops(self) -> float:
        return sum(node.fwd_flops for node in self.calls())

    @property
    def bwd_flops(self) -> float:
        return sum(node.bwd_flops for node in self.calls())

    def storage_root(self, name: str, output_index: int = 0) -> str:
        """The node whose output owns the storage that `name` views."""
        node = self.by_name[name]
        while node.alias_input is not None:
            node = self.by_name[node.inputs[node.alias_input]]
        return node.name

    def saved_activation_bytes(self, names: Iterable[str] | None = None) -> float:
        """Bytes the backward pass keeps alive for the given call nodes (default: all).

        A tensor saved by several ops, or through several views, counts once: what is kept is
        the storage of its root. Parameters and buffers are not activations.
        """
        selected = list(self.calls()) if names is None else [self.by_name[name] for name in names]
        roots: set[str] = set()
        extra = 0.0
        for node in selected:
            extra += node.saved_extra_bytes
            sources = [node.inputs[index] for index in node.saved_inputs]
            if node.saved_output:
                sources.append(node.name)
            for source in sources:
                root = self.by_name[self.storage_root(source)]
                if root.kind == "call":
                    roots.add(root.name)
        return extra + sum(self.by_name[root].output.nbytes for root in roots)

    def with_batch(self, batch_size: int) -> "OpGraph":
        """The same graph with every shape and cost at another batch size.

        Matmul FLOPs and saved extras scale with the batch when the op touches a batch-sized
        tensor; bytes scale with the op's own input + output bytes (weights do not grow).
        """
        if batch_size == self.batch_size:
            return self
        if not self.batch_dynamic:
            raise ValueError(f"graph was captured with a fixed batch of {self.batch_size}; "
                             "capture with a dynamic batch to price other microbatch sizes")
        old_outputs = {node.name: node.outputs for node in self.nodes}
        new_outputs = {name: tuple(meta.at_batch(self.batch_size, batch_size) for meta in metas)
                       for name, metas in old_outputs.items()}
        nodes = tuple(_node_at_batch(node, old_outputs, new_outputs, batch_size / self.batch_size)
                      for node in self.nodes)
        return replace(self, nodes=nodes, batch_size=batch_size)

    @cached_property
    def recomputed_activations(self) -> frozenset[str]:
        """Gated activations whose output their product saves as a recipe (`recomputed_inputs`)."""
        return frozenset(node.inputs[index] for node in self.calls() for index in node.recomputed_inputs)

    @cached_property
    def loss_nodes(self) -> frozenset[str]:
        """The loss part: the targets input and every node that depends on it."""
        found = {node.name for node in self.nodes if node.kind == "target" or node.module_path == "<loss>"}
        for node in self.nodes:
            if node.kind != "output" and any(source in found for source in node.inputs):
                found.add(node.name)
        return frozenset(found)

    def fingerprint(self) -> str:
        """Hash of the model's ops and shapes (at batch 1 when dynamic): identifies the model
        whether captured in fp32 on CPU or as a bf16 replica on meta, with or without its loss
        (dtypes, node names and the loss part are left out)."""
        batch = 1 if self.batch_dynamic else self.batch_size  # shapes only: no costs rescaled
        model_nodes = [node for node in self.nodes if node.name not in self.loss_nodes and node.kind != "output"]
        # Layout-only copies come and go with the device a model is traced on (Hugging Face
        # code makes tensors contiguous on some devices only), and casts with its dtype (_CASTS):
        # they are not part of the identity.
        alias = {node.name: node.inputs[0] for node in model_nodes
                 if (node.target in _LAYOUT_ONLY or node.target in _CASTS) and node.inputs}
        model_nodes = [node for node in model_nodes if node.name not in alias]
        position = {node.name: index for index, node in enumerate(model_nodes)}

        def resolve(name: str) -> str:
            while name in alias:
                name = alias[name]
            return name

        digest = hashlib.sha256()
        for node in model_nodes:
            shapes = [meta.at_batch(self.batch_size, batch).shape for meta in node.outputs]
            inputs = [position.get(resolve(source), -1) for source in node.inputs]
            target = node.target if node.kind != "input" else ""  # input names differ under WithLoss
            digest.update(repr((node.kind, target, inputs, shapes)).encode())
        return digest.hexdigest()[:16]

def _io_bytes(node: OpNode, outputs: dict[str, tuple[TensorMeta, ...]]) -> float:
    metas = [meta for name in node.inputs for meta in outputs[name][:1]] + list(outputs[node.name])
    return float(sum(meta.nbytes for meta in metas))


def _node_at_batch(node: OpNode, old: dict, new: dict, batch_scale: float) -> OpNode:
    outputs = new[node.name]
    touches_batch = outputs != node.outputs or any(new[name] != old[name] for name in node.inputs)
    if not touches_batch:
        return node
    old_bytes = _io_bytes(node, old)
    bytes_scale = _io_bytes(node, new) / old_bytes if old_bytes else batch_scale

    def scaled(kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
        return tuple(replace(kernel, flops=kernel.flops * batch_scale, io_bytes=kernel.io_bytes * bytes_scale)
                     for kernel in kernels)

    return replace(node, outputs=outputs, fwd_kernels=scaled(node.fwd_kernels), bwd_kernels=scaled(node.bwd_kernels),
                   saved_extra_bytes=node.saved_extra_bytes * batch_scale)

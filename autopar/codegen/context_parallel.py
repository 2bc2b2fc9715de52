"""Context parallelism at run time: each sequence split over the cp ranks of the mesh.

The sequence is cut into 2 cp chunks and rank r keeps chunks r and 2 cp - 1 - r (load-balanced
causal attention, as the planner priced it: solver/context_parallel.py). The program is the
model exported at the local length seq / cp (shapes are static in the export), run on each
rank's tokens with three ops replaced, all position-aware:

- `aten.arange(seq / cp)` (positions made in the forward: learned position embeddings, Hugging
  Face's cache_position) gives this rank's global positions;
- `aten.slice(buffer, dim, 0, seq / cp)` of a position table (rotary cos/sin buffers) takes the
  rows of this rank's positions;
- `aten.scaled_dot_product_attention` all-gathers K and V over the cp group (one collective;
  its backward reduce-scatters dK and dV; of the kv heads only when the model repeated them
  for every query head, see `strategies.attention.kv_repeats`), then attends each local chunk of queries to the
  keys up to it (causal, bottom-right aligned: each rank does 1 / cp of the causal work). This is Llama 3's all-gather context parallelism
  (torch's `context_parallel` has no CPU path: it dispatches the flash/efficient/cuDNN kernels).

Parameters are replicated over cp and their gradients reduced over dp x cp (averaged, as each
rank's loss is the mean over its own tokens, the same number on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.attention.bias import causal_lower_right

from autopar.codegen.data_parallel import sum_over_group
from autopar.codegen.loss_parallel import replicated_local
from autopar.codegen.parallel_module import ParallelModule
from autopar.errors import ConfigError
from autopar.strategies.attention import attention_nodes, kv_repeats

_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
_SLICE = torch.ops.aten.slice.Tensor
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds: chunks rank and 2 cp - 1 - rank."""
    if seq_len % (2 * cp):
        raise ConfigError(f"a sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks; "
                          "use a cp dividing half the sequence")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def has_sequence(value, seq_len: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len


def shard_sequence(value, positions: torch.Tensor, seq_len: int):
    """This rank's tokens of a (batch, seq, ...) tensor; anything else unchanged."""
    if not has_sequence(value, seq_len):
        return value
    return value.index_select(1, positions.to(value.device))


def local_inputs(values: tuple, seq_len: int, cp: int) -> tuple:
    """Example inputs at the local length (the first seq / cp tokens), to export the local program."""
    return tuple(value[:, :seq_len // cp] if has_sequence(value, seq_len) else value for value in values)


class _GatherKV(torch.autograd.Function):
    """All-gather of a flat buffer over the cp group; backward: reduce-scatter (sum) of its gradient."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        gathered = flat.new_empty(size * flat.numel())  # gloo takes 1-d buffers only
        dist.all_gather_into_tensor(gathered, flat.contiguous(), group=group)
        return gathered.view(size, flat.numel())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(local, grad.contiguous().view(-1), group=ctx.group)
        return local, None, None


class ContextParallelOps:
    """The replacements the interpreter calls for position-aware ops (see the module docstring)."""

    def __init__(self, *, seq_len: int, cp: int, rank: int, group, device: torch.device,
                 table_placeholders: set[str], kv_repeats: dict[str, int] | None = None) -> None:
        self.seq_len, self.cp, self.group = seq_len, cp, group
        self.kv_repeats = kv_repeats or {}
        """Per attention node, how many times its K and V repeat each kv head (absent: 1)."""
        self.local_len = seq_len // cp
        self.positions = chunk_positions(seq_len, cp, rank).to(device)
        self.key_order = torch.argsort(torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])).to(device)
        """Gathered keys (rank order) -> sequence order."""
        self.chunk_starts = (int(self.positions[0]), int(self.positions[self.local_len // 2]))
        self.table_placeholders = table_placeholders
        self.calls = {"all_gather": 0, "reduce_scatter": 0}

    def install(self, interpreter) -> None:
        for target in _ARANGES:
            interpreter.overrides[target] = self.arange
        interpreter.overrides[_SLICE] = self.slice
        interpreter.overrides[_SDPA] = self.attention

    def arange(self, node, args, kwargs):
        start, end, step = _arange_bounds(node.target, args)
        if (start, end, step) != (0, self.local_len, 1):
            return node.target(*args, **kwargs)
        dtype = kwargs.get("dtype") or torch.int64
        return self.positions.to(dtype=dtype, device=kwargs.get("device") or self.positions.device)

    def slice(self, node, args, kwargs):
        source, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
        start = args[2] if len(args) > 2 else kwargs.get("start")
        end = args[3] if len(args) > 3 else kwargs.get("end")
        step = args[4] if len(args) > 4 else kwargs.get("step", 1)
        from_table = isinstance(node.args[0], torch.fx.Node) and node.args[0].name in self.table_placeholders
        if not (from_table and start in (0, None) and end == self.local_len and step == 1
                and source.shape[dim] >= self.seq_len):
            return node.target(*args, **kwargs)
        if isinstance(source, DTensor):  # a replicated table on the tp mesh: take the rows locally
            if not all(placement.is_replicate() for placement in source.placements):
                return node.target(*args, **kwargs)
            rows = source.to_local().index_select(dim, self.positions)
            return DTensor.from_local(rows, source.device_mesh, source.placements, run_check=False)
        return source.index_select(dim, self.positions)

    def attention(self, node, args, kwargs):
        query, key, value = args[:3]
        attn_mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        is_causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        if attn_mask is not None:
            raise ConfigError(f"context parallelism runs causal or unmasked attention; {node.name} passes an explicit "
                              "attn_mask: plan with cp=1")
        repeats = self.kv_repeats.get(node.name, 1)
        if isinstance(query, DTensor):  # tensor parallel too: attend the local heads
            local = self._attend(query.to_local(), key.to_local(), value.to_local(), dropout_p, is_causal, kwargs,
                                 repeats)
            return DTensor.from_local(local, query.device_mesh, query.placements, run_check=False)
        return self._attend(query, key, value, dropout_p, is_causal, kwargs, repeats)

    def _attend(self, query, key, value, dropout_p, is_causal, kwargs, repeats: int = 1):
        enable_gqa = kwargs.get("enable_gqa", False)
        if repeats > 1 and key.dim() == 4 and key.shape[1] % repeats == 0:
            # Every `repeats`-th head is the kv head itself: gather those and attend grouped. The
            # gradient reaches one copy per group; the repeat's backward sums the copies anyway.
            key, value, enable_gqa = key[:, ::repeats], value[:, ::repeats], True
        flat = torch.cat([key.reshape(-1), value.reshape(-1)])
        gathered = _GatherKV.apply(flat, self.group, self.cp)
        self.calls["all_gather"] += 1
        self.calls["reduce_scatter"] += int(flat.requires_grad)
        split = key.numel()
        keys = torch.cat([row[:split].view(key.shape) for row in gathered], dim=-2)
        values = torch.cat([row[split:].view(value.shape) for row in gathered], dim=-2)
        options = dict(dropout_p=dropout_p, scale=kwargs.get("scale"), enable_gqa=enable_gqa)
        if not is_causal:
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, **options)
        # Keys in sequence order; each local chunk attends to the prefix that ends with it (causal,
        # aligned to the bottom right): the load-balanced share of the work the planner priced.
        keys, values = keys.index_select(-2, self.key_order), values.index_select(-2, self.key_order)
        chunk = self.local_len // 2
        parts = []
        for index, start in enumerate(self.chunk_starts):
            end = start + chunk
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                query[..., index * chunk:(index + 1) * chunk, :], keys[..., :end, :], values[..., :end, :],
                attn_mask=causal_lower_right(chunk, end), **options))
        return torch.cat(parts, dim=-2)


def _arange_bounds(target, args) -> tuple:
    if target is torch.ops.aten.arange.default:
        return 0, args[0], 1
    if target is torch.ops.aten.arange.start:
        return args[0], args[1], 1
    return args[0], args[1], args[2] if len(args) > 2 else 1


class ContextParallelModule(ParallelModule):
    """A ParallelModule whose ranks of one cp group each run their chunks of every sequence."""

    def __init__(self, *, seq_len: int, ops: ContextParallelOps, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seq_len = seq_len
        self.context_parallel_ops = ops
        """The interpreter's position-aware ops; `calls` counts the KV collectives they ran."""
        self.cp = self.plan.mesh["cp"]
        self.positions = chunk_positions(seq_len, self.cp, self.runtime.coordinate("cp"))

    def _local_batch(self, inputs, targets):
        inputs, targets = super()._local_batch(inputs, targets)
        return ([shard_sequence(value, self.positions, self.seq_len) for value in inputs],
                shard_sequence(targets, self.positions, self.seq_len))

    def forward(self, *inputs, **keyword_inputs):
        """The whole output (every token of the global batch), as without cp."""
        if self.plan.mesh["pp"] > 1:
            return super().forward(*inputs, **keyword_inputs)
        flat_inputs = self._flat_inputs(inputs, keyword_inputs)
        local = self._is_local_batch(flat_inputs)
        shares = [shard_sequence(self._data_parallel_share(x, local), self.positions, self.seq_len) for x in flat_inputs]
        output = self.stages[0](*shares)
        values = replicated_local(output if isinstance(output, tuple) else (output,))
        values = [self._gather_sequence(value) for value in values]
        return self.model_output(tuple(values if local else (self._gather_batch(value) for value in values)))

    def _gather_sequence(self, value):
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != self.seq_len // self.cp:
            return value
        pieces = [torch.empty_like(value) for _ in range(self.cp)]
        dist.all_gather(pieces, value.contiguous(), group=self.runtime.cp_group)
        whole = torch.empty((value.shape[0], self.seq_len, *value.shape[2:]), dtype=value.dtype, device=value.device)
        order = torch.cat([chunk_positions(self.seq_len, self.cp, r) for r in range(self.cp)]).to(value.device)
        whole[:, order] = torch.cat(pieces, dim=1)
        return whole

    def _gradient_replicas(self):
        """Every rank of a cp group holds the whole model: gradients are averaged over dp x cp."""
        return self.runtime.reduce_mesh.get_group(), self.plan.mesh["dp"] * self.cp

    def _mean_over_data_parallel(self, loss: torch.Tensor) -> torch.Tensor:
        return sum_over_group(loss, self.runtime.reduce_mesh.get_group()) / (self.plan.mesh["dp"] * self.cp)


def local_program(model, inputs: tuple, keywords: dict, graph, plan):
    """(program, graph, seq_len): the model exported at this rank's share of the sequence."""
    from autopar.capture.compute_dtype import capture_for_codegen
    from autopar.solver.context_parallel import sequence_length

    seq_len = sequence_length(graph)
    cp = plan.mesh["cp"]
    if seq_len <= 1 or seq_len % (2 * cp):
        raise ConfigError(f"the plan splits sequences over cp={cp} ranks, but the model's inputs have "
                          f"{seq_len} tokens, not a multiple of 2 x cp = {2 * cp}: re-plan for these inputs")
    local_keywords = dict(zip(keywords, local_inputs(tuple(keywords.values()), seq_len, cp)))
    program, local_graph = capture_for_codegen(model, local_inputs(tuple(inputs), seq_len, cp), local_keywords,
                                               precision=plan.precision)
    return program, local_graph, seq_len


def ops_for(parts, seq_len: int, runtime) -> ContextParallelOps:
    tables = set(parts.buffer_of) | set(parts.constant_of)
    repeats = {node.name: kv_repeats(parts.graph, node) for node in attention_nodes(parts.graph)}
    return ContextParallelOps(seq_len=seq_len, cp=runtime.mesh["cp"].size(), rank=runtime.coordinate("cp"),
                              group=runtime.cp_group, device=runtime.device, table_placeholders=tables,
                              kv_repeats={name: count for name, count in repeats.items() if count > 1})

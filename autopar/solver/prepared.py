"""Per-segment arrays of one intra-op solution under one recomputation mode.

The search prices thousands of configurations from the same few (tp, microbatch, recompute,
cp) solutions, and a stage is a union of contiguous runs of segments (one per model chunk),
so every per-stage sum is a difference of prefix sums (`total`), and identical segments (the
blocks of a deep model) carry one signature id, so identical stages share what is cached by
content (`signature`). See step_model.py for what each array means in the step's price.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from operator import attrgetter

import numpy as np

from autopar.solver.costing import CommEvent
from autopar.solver.evaluate import SegmentCost
from autopar.solver.experts import GroupedMatmul
from autopar.solver.pipeline import ChainCosts, StageSpan, partition
from autopar.solver.recompute import REGATHER_MODES
from autopar.solver.recompute_modules import is_modules_mode, mode_kinds
from autopar.solver.tp_windows import Windowed, hideable_s, windowed


@dataclass(frozen=True)
class EpTimes:
    """Expert parallelism's terms per segment, per microbatch, at one (ep, tp, devices per node)."""

    forward_s: np.ndarray
    """All-to-alls of the forward (a full recompute's replay included)."""
    backward_s: np.ndarray
    parts_s: dict[str, np.ndarray]
    """The same all-to-alls by part: "counts", "dispatch", "combine", and the rows' "reorder" around
    them (solver/experts.py; in forward_s and backward_s too)."""
    load_imbalance_s: np.ndarray
    """Grouped-matmul time the busiest rank adds over the even share (>= 0)."""
    shape_forward_s: np.ndarray
    """Change of the forward grouped matmuls' time from running E / ep experts of ep x the rows
    each instead of E (bigger matmuls run faster: <= 0, within the expert compute itself)."""
    shape_backward_s: np.ndarray

    @property
    def total_s(self) -> np.ndarray:
        return self.forward_s + self.backward_s + self.load_imbalance_s + self.shape_forward_s + self.shape_backward_s

@dataclass
class PreparedSegments:
    """Per-segment arrays for one intra-op solution and recomputation mode (reused by every
    pp, dp, schedule and ZeRO stage the search tries)."""

    names: list[str]
    recompute: str
    forward_s: np.ndarray
    backward_s: np.ndarray
    recompute_s: np.ndarray
    comm_by_op_s: dict[str, np.ndarray]
    overlap_caps_s: dict[str, np.ndarray]
    """Per comm_by_op_s column, the seconds of its collectives their GEMM windows can cover
    (tp_windows.hideable_s): what tensor-parallel overlap may hide of them (solver/tp_overlap.py)."""
    forward_comm_s: np.ndarray
    """Collectives of the forward pass itself (not a full recompute's replay)."""
    weight_grad_s: np.ndarray
    """Weight-gradient compute (see the module docstring)."""
    time_s: np.ndarray
    activation_bytes: np.ndarray
    param_numel: np.ndarray
    buffer_bytes: np.ndarray
    output_bytes: np.ndarray
    max_saved_bytes: float
    max_recomputed_bytes: float = 0.0
    """Largest set of tensors one segment regenerates in backward (saved minus kept)."""
    grad_workspace_bytes: np.ndarray | None = None
    """Per segment, the largest gradients one op's backward holds at once (evaluate.py)."""
    time_partitions: dict[tuple, list[StageSpan] | None] = field(default_factory=dict)
    """Fastest partitions without a memory bound, by chunks (and the chain, when its times are not time_s)."""
    lean_partitions: dict[tuple, list[StageSpan] | None] = field(default_factory=dict)
    """Memory-bounded partitions by (chunks, chain, microbatches in flight per chunk, workspace)."""
    chains: dict[tuple, object] = field(default_factory=dict)
    """StepModel.chain by what it depends on (dp x cp, dp, ZeRO stage, offload, ep)."""
    expert_numel: np.ndarray | None = None
    """Per segment, the expert weights among param_numel (None: no expert ops)."""
    ep_messages: tuple[tuple[tuple[float, str, bool, str, int, bool], ...], ...] = ()
    """Per segment, its expert ops' all-to-alls: (bytes, "fwd" | "bwd", dropless, part: "counts",
    "dispatch" or "combine", the op's experts on the device before ep, ExpertExchange.rows_whole);
    a full recompute repeats the forward ones."""
    ep_matmuls: tuple[tuple[GroupedMatmul, ...], ...] = ()
    """Per segment, its dropless expert ops' grouped-matmul kernels (what ep reshapes and load
    imbalance stretches); a full recompute repeats the forward ones."""
    tp_windowed: tuple[tuple[Windowed, ...], ...] = ()
    """Per segment, its collectives (recomputation's replays included) as tp_windows.windowed
    keeps them: what overlap_caps_s is summed from, again with faster GEMMs (with_compute_change)."""
    gathered_output_bytes: np.ndarray | None = None
    """Per segment, the whole size of the replicated activations among output_bytes (sent as
    slices, all-gathered over tp by the receiving stage)."""
    fused_wgrad_numel: np.ndarray | None = None
    """Per segment, the weights whose gradients the runtime can accumulate inside their GEMMs
    (evaluate.SegmentCost.fused_wgrad_numel; zeros on CPU clusters)."""
    fused_wgrad_saving_s: np.ndarray | None = None
    """Per segment, what a configuration that fuses them saves per microbatch (not taken off time_s:
    StepModel._stage_parts takes it off where the configuration fuses)."""
    grad_reduce_s: np.ndarray | None = None
    """Per segment, the reductions of weights' Partial gradients (a replicated norm weight read by
    sequence-sharded activations): the runtime makes them once per step, after the last
    microbatch (codegen/data_parallel.reduce_partial_gradients), so they are not in time_s."""
    ep_region_fwd_s: np.ndarray | None = None
    """Per segment, the forward collectives around and inside its MoE layers' token-local regions
    (SegmentCost.expert_region_comm), with those recomputation replays; None: no expert ops."""
    ep_region_bwd_s: np.ndarray | None = None
    """The same of the backward."""
    ep_times: dict[tuple, EpTimes] = field(default_factory=dict)
    """Cache per (ep, tp, devices per node) of expert parallelism's terms (StepModel.ep_times)."""
    fsdp_cache: dict[tuple, tuple] = field(default_factory=dict)
    """StepModel._fsdp by (a stage's segment costs, dp x cp, pp, tp, ZeRO stage): identical stages, and
    configurations differing only in microbatch count or schedule, share one FSDP2 timeline."""

    _prefixes: dict[str, list[float]] = field(default_factory=dict, repr=False)
    _lists: dict[str, list[float]] = field(default_factory=dict, repr=False)
    _signatures: list[int] | None = field(default=None, repr=False)
    _slowest_chunk_s: dict[int, float] = field(default_factory=dict, repr=False)
    stage_cache: dict[tuple, dict] = field(default_factory=dict, repr=False)
    """StepModel._stage's parts that do not depend on where the stage sits (see step_model.py)."""
    lightest_cache: dict[tuple, str | None] = field(default_factory=dict, repr=False)
    """StepModel._lightest's choice of mode (None: the stage's own) by what it depends on."""
    workspace_cache: dict[tuple, dict[str, float]] = field(default_factory=dict, repr=False)
    """StepModel._workspace_terms by (segments' signature, what of the configuration they read)."""

    @classmethod
    def build(cls, segments: list[SegmentCost], recompute: str) -> "PreparedSegments":
        # A deep model's blocks are copies of one cost (condense.expand_segments shares every
        # field but the name): each distinct cost is reduced to its row once, then indexed.
        rows: dict[tuple, int] = {}
        distinct: list[SegmentCost] = []
        index = []
        for segment in segments:
            key = tuple(map(id, _content(segment)))
            if key not in rows:
                rows[key] = len(distinct)
                distinct.append(segment)
            index.append(rows[key])
        prepared = cls._build_distinct(distinct, recompute)
        return prepared._indexed(np.asarray(index, dtype=int), [s.name for s in segments])

    @classmethod
    def _build_distinct(cls, segments: list[SegmentCost], recompute: str) -> "PreparedSegments":
        comm: dict[str, np.ndarray] = {}
        records: list[list[Windowed]] = [[] for _ in segments]
        forward_comm = np.zeros(len(segments))
        grad_reduce = np.zeros(len(segments))
        for index, segment in enumerate(segments):
            forward_comm[index] = segment.comm_s("fwd")
            for event in segment.comm:
                if once_per_step(event):
                    grad_reduce[index] += event.time_s
                else:
                    _add_event(comm, event, index, len(segments), records[index])
            for op, seconds in recompute_comm_s(segment, recompute, records[index]).items():
                _column(comm, op, len(segments))[index] += seconds
            for event in segment.selective_recompute_comm if recompute == "selective" else ():
                _add_event(comm, event, index, len(segments), records[index])
        array = lambda values: np.asarray(list(values), dtype=float)  # noqa: E731
        forward = array(s.forward.total_s for s in segments)
        backward = array(s.backward.total_s for s in segments)
        recomputed = array(recompute_compute_s(s, recompute) for s in segments)
        total_comm = sum(comm.values()) if comm else np.zeros(len(segments))
        experts = any(s.expert_exchanges for s in segments)
        repeat = 2 if recompute == "full" or (is_modules_mode(recompute) and "moe" in mode_kinds(recompute)) else 1
        messages = tuple(tuple((size, phase, exchange.dropless, part, exchange.device_experts, exchange.rows_whole)
                               for exchange in s.expert_exchanges
                               for size, phase, part in exchange.messages()
                               for _ in range(repeat if phase == "fwd" else 1))
                         for s in segments)
        matmuls = tuple(tuple(matmul for exchange in s.expert_exchanges if exchange.dropless
                              for matmul in exchange.matmuls for _ in range(repeat if matmul.phase == "fwd" else 1))
                        for s in segments)
        region = {phase: array(_region_comm_s(s, recompute, phase) for s in segments) if experts else None
                  for phase in ("fwd", "bwd")}
        return cls(names=[s.name for s in segments], recompute=recompute, forward_s=forward, backward_s=backward,
                   expert_numel=array(s.expert_param_numel for s in segments) if experts else None,
                   ep_region_fwd_s=region["fwd"], ep_region_bwd_s=region["bwd"],
                   ep_messages=messages if experts else (), ep_matmuls=matmuls if experts else (),
                   recompute_s=recomputed, comm_by_op_s=comm, overlap_caps_s=_caps(records, comm),
                   tp_windowed=tuple(map(tuple, records)), forward_comm_s=forward_comm,
                   weight_grad_s=array(weight_grad_s(s) for s in segments),
                   time_s=forward + backward + recomputed + total_comm,
                   activation_bytes=array(_activation_bytes(s, recompute) for s in segments),
                   param_numel=array(s.param_numel for s in segments),
                   buffer_bytes=array(s.buffer_bytes for s in segments),
                   output_bytes=array(s.output_bytes for s in segments),
                   gathered_output_bytes=array(s.gathered_output_bytes for s in segments),
                   grad_workspace_bytes=array(s.grad_workspace_bytes for s in segments),
                   grad_reduce_s=grad_reduce,
                   fused_wgrad_numel=array(s.fused_wgrad_numel for s in segments),
                   fused_wgrad_saving_s=array(s.fused_wgrad_saving.total_s for s in segments),
                   max_saved_bytes=max((s.saved_bytes for s in segments), default=0.0),
                   max_recomputed_bytes=max((max(0.0, s.saved_bytes - _activation_bytes(s, recompute))
                                             for s in segments), default=0.0))

    def with_compute_change(self, forward_s: np.ndarray, backward_s: np.ndarray, recompute_s: np.ndarray,
                            weight_grad_s: np.ndarray, gemm_speedups: dict[str, float] | None = None
                            ) -> "PreparedSegments":
        """These segments with each one's compute changed by the seconds given per microbatch (the
        float8 linears' matmuls in place of their bf16 ones: solver/fp8_segments.py), every cache
        fresh: the stage cut, the overlap of collectives with compute and the bubble all see the
        changed times; `gemm_speedups`: per GEMM node, how many times faster it now runs (the
        collectives' GEMM windows shrink alike: overlap_caps_s)."""
        arrays = {f.name: value for f in fields(self) if isinstance(value := getattr(self, f.name), np.ndarray)}
        arrays.update(forward_s=self.forward_s + forward_s, backward_s=self.backward_s + backward_s,
                      recompute_s=self.recompute_s + recompute_s, weight_grad_s=self.weight_grad_s + weight_grad_s,
                      time_s=self.time_s + forward_s + backward_s + recompute_s)
        return PreparedSegments(
            names=list(self.names), recompute=self.recompute, max_saved_bytes=self.max_saved_bytes,
            max_recomputed_bytes=self.max_recomputed_bytes, comm_by_op_s=dict(self.comm_by_op_s),
            overlap_caps_s=_caps(self.tp_windowed, self.comm_by_op_s, gemm_speedups) if gemm_speedups and
            self.tp_windowed else dict(self.overlap_caps_s), tp_windowed=self.tp_windowed,
            ep_messages=self.ep_messages, ep_matmuls=self.ep_matmuls, **arrays)

    @classmethod
    def mixed(cls, none: "PreparedSegments", full: "PreparedSegments", flags: Sequence[bool], mode: str, *,
              workspace: bool = True) -> "PreparedSegments":
        """Segments taking each row from `full` where `flags` says it is recomputed, from `none`
        elsewhere (every per-segment array, column and record; caches fresh): the "blocks:<N>"
        mode (solver/recompute_blocks.py); `workspace` False: its regenerated tensors need no
        room of their own (recompute_blocks.holds_others)."""
        pick = np.asarray(flags, dtype=bool)
        if len(pick) != len(none.names) or none.names != full.names:
            raise ValueError("mixed: both modes' segments and the flags must list the same segments")
        rows = pick.tolist()
        arrays = {f.name: np.where(pick, high, low) for f in fields(cls)
                  if isinstance(low := getattr(none, f.name), np.ndarray)
                  and isinstance(high := getattr(full, f.name), np.ndarray)}
        recomputed_bytes = full.max_recomputed_bytes if any(rows) and workspace else none.max_recomputed_bytes
        return cls(names=list(none.names), recompute=mode,
                   max_saved_bytes=max(none.max_saved_bytes, full.max_saved_bytes),
                   max_recomputed_bytes=recomputed_bytes,
                   comm_by_op_s=_mixed_columns(none.comm_by_op_s, full.comm_by_op_s, pick),
                   overlap_caps_s=_mixed_columns(none.overlap_caps_s, full.overlap_caps_s, pick),
                   tp_windowed=_mixed_rows(none.tp_windowed, full.tp_windowed, rows),
                   ep_messages=_mixed_rows(none.ep_messages, full.ep_messages, rows),
                   ep_matmuls=_mixed_rows(none.ep_matmuls, full.ep_matmuls, rows), **arrays)

    def _indexed(self, index: np.ndarray, names: list[str]) -> "PreparedSegments":
        """These rows repeated as `index` says, named `names` (every per-segment array)."""
        arrays = {f.name: value[index] for f in fields(self) if isinstance(value := getattr(self, f.name), np.ndarray)}
        return PreparedSegments(
            names=names, recompute=self.recompute, max_saved_bytes=self.max_saved_bytes,
            max_recomputed_bytes=self.max_recomputed_bytes,
            comm_by_op_s={op: values[index] for op, values in self.comm_by_op_s.items()},
            overlap_caps_s={op: values[index] for op, values in self.overlap_caps_s.items()},
            tp_windowed=tuple(self.tp_windowed[i] for i in index.tolist()) if self.tp_windowed else (),
            ep_messages=tuple(self.ep_messages[i] for i in index.tolist()) if self.ep_messages else (),
            ep_matmuls=tuple(self.ep_matmuls[i] for i in index.tolist()) if self.ep_matmuls else (), **arrays)

    def total(self, name: str, own: Sequence[StageSpan]) -> float:
        """Sum of array `name` (an attribute, "comm:<op>" of comm_by_op_s or "cap:<op>" of
        overlap_caps_s) over the spans."""
        prefix = self._prefixes.get(name)
        if prefix is None:
            values = self.comm_by_op_s[name[5:]] if name.startswith("comm:") else \
                self.overlap_caps_s[name[4:]] if name.startswith("cap:") else getattr(self, name)
            prefix = self._prefixes[name] = np.concatenate(([0.0], np.cumsum(values))).tolist()
        if len(own) == 1:
            return prefix[own[0].stop] - prefix[own[0].start]
        return sum(prefix[span.stop] - prefix[span.start] for span in own)

    @property
    def work_s(self) -> float:
        """time_s over every segment: one microbatch through the whole model on one device."""
        return self.total("time_s", (StageSpan(0, len(self)),))

    @cached_property
    def ep_saving_bound_s(self) -> float:
        """The most expert parallelism can take off work_s: its grouped matmuls' time without
        it (under ep they run fewer, bigger experts, faster; StepModel.ep_times), for lower bounds."""
        return sum(matmul.alone_s for matmuls in self.ep_matmuls for matmul in matmuls)

    @cached_property
    def fused_wgrad_saving_bound_s(self) -> float:
        """The most fusing weight gradients into their GEMMs can take off work_s (StepModel takes
        it off where the configuration fuses), for lower bounds."""
        return float(self.fused_wgrad_saving_s.sum()) if self.fused_wgrad_saving_s is not None else 0.0

    def listed(self, name: str) -> list[float]:
        """Array `name` as plain floats (cheaper to index one by one than numpy's)."""
        listed = self._lists.get(name)
        if listed is None:
            listed = self._lists[name] = np.asarray(getattr(self, name), dtype=float).tolist()
        return listed

    def values(self, name: str, own: Sequence[StageSpan]) -> list[float]:
        """Array `name`'s entries of the spans' segments, in order."""
        listed = self.listed(name)
        return [value for span in own for value in listed[span.start:span.stop]]

    def signature(self, own: Sequence[StageSpan]) -> tuple[int, ...]:
        """Ids of the spans' segments by content: equal for stages of identical segments."""
        if self._signatures is None:
            arrays = [self.forward_s, self.backward_s, self.recompute_s, self.forward_comm_s, self.weight_grad_s,
                      self.time_s, self.activation_bytes, self.param_numel, self.buffer_bytes, self.output_bytes,
                      *self.comm_by_op_s.values(), *self.overlap_caps_s.values()]
            arrays += [a for a in (self.grad_workspace_bytes, self.expert_numel, self.grad_reduce_s,
                                   self.gathered_output_bytes, self.fused_wgrad_numel, self.fused_wgrad_saving_s,
                                   self.ep_region_fwd_s, self.ep_region_bwd_s)
                       if a is not None]
            ids: dict[tuple, int] = {}
            rows = zip(*(np.asarray(a, dtype=float).tolist() for a in arrays), self.ep_messages or [()] * len(self),
                       self.ep_matmuls or [()] * len(self))
            self._signatures = [ids.setdefault(row, len(ids)) for row in rows]
        if len(own) == 1:
            return tuple(self._signatures[own[0].start:own[0].stop])
        return tuple(i for span in own for i in self._signatures[span.start:span.stop])

    @cached_property
    def whole(self) -> tuple[list[StageSpan], tuple[int, ...]]:
        """Every segment as one stage: (its span list, its signature), for terms bounded over stages."""
        spans = [StageSpan(0, len(self))]
        return spans, self.signature(spans)

    def time_partition(self, num_chunks: int) -> list[StageSpan] | None:
        """The most balanced cut of time_s into `num_chunks` contiguous chunks (no memory bound);
        None when there are fewer segments."""
        if num_chunks not in self.time_partitions:
            zeros = np.zeros(len(self))
            self.time_partitions[num_chunks] = partition(
                ChainCosts(time_s=self.time_s, state_bytes=zeros, activation_bytes=zeros), num_chunks,
                in_flight=lambda chunk: 0.0)
        return self.time_partitions[num_chunks]

    def slowest_chunk_s(self, num_chunks: int) -> float:
        """A lower bound on the slowest of `num_chunks` contiguous chunks' time_s, however the
        segments are cut (the balanced partition's, less its bisection tolerance); 0 when they
        cannot be cut so."""
        if num_chunks not in self._slowest_chunk_s:
            spans = self.time_partition(num_chunks)
            self._slowest_chunk_s[num_chunks] = 0.0 if spans is None else \
                (1 - 2e-4) * max(self.total("time_s", (span,)) for span in spans)
        return self._slowest_chunk_s[num_chunks]

    def same_as(self, other: "PreparedSegments") -> bool:
        """Prices every configuration as `other` does (a mode that changes nothing for this model,
        such as re-gathering without tensor parallelism)."""
        return (np.array_equal(self.time_s, other.time_s) and np.array_equal(self.activation_bytes, other.activation_bytes)
                and self.max_recomputed_bytes == other.max_recomputed_bytes)

    def __len__(self) -> int:
        return len(self.names)


def once_per_step(event) -> bool:
    """A weight's Partial gradient reduced (all-reduce to a replicated weight, reduce-scatter to a
    sharded one): the runtime sums the microbatches' partial gradients first and reduces once."""
    return event.phase == "grad" and event.op in ("all_reduce", "reduce_scatter")


def _mixed_columns(low: dict[str, np.ndarray], high: dict[str, np.ndarray], pick: np.ndarray) -> dict[str, np.ndarray]:
    zeros = np.zeros(len(pick))
    return {key: np.where(pick, high.get(key, zeros), low.get(key, zeros)) for key in {**low, **high}}


def _mixed_rows(low: tuple, high: tuple, rows: list[bool]) -> tuple:
    if not low and not high:
        return ()
    low, high = low or ((),) * len(rows), high or ((),) * len(rows)
    return tuple(high[index] if recomputed else low[index] for index, recomputed in enumerate(rows))


_content = attrgetter(*(f.name for f in fields(SegmentCost) if f.name != "name"))
"""What a segment's cost is made of besides its name (copies of one cost share these objects)."""


def weight_grad_s(segment: SegmentCost) -> float:
    """Weight-gradient compute of a segment: the forward time of its weight-bearing ops (the ops
    selective recompute does not re-run) and the weight gradients' cast to fp32 (which follows
    them), at most its whole backward."""
    weighted = segment.forward.total_s - segment.selective_recompute.total_s + segment.cast.total_s
    return min(max(weighted, 0.0), segment.backward.total_s)


def recompute_compute_s(segment: SegmentCost, recompute: str) -> float:
    """Compute time re-run in backward (its collectives are in recompute_comm_s)."""
    if recompute == "full":
        return segment.forward.total_s
    if recompute == "selective":
        return segment.selective_recompute.total_s
    if recompute == "op":
        return segment.op_recompute.total_s
    if is_modules_mode(recompute):
        return segment.modules_recompute(recompute).total_s
    # The gated activations' products are kept: their backward runs the activation again.
    return segment.activation_recompute.total_s


_REDUCING = ("reduce_scatter", "all_reduce")


def _region_comm_s(segment: SegmentCost, recompute: str, phase: str) -> float:
    """Seconds of the segment's MoE-region collectives in `phase` (SegmentCost.expert_region_comm),
    the forward ones recomputation replays (replayed_comm) counted again."""
    events = [event for event in segment.expert_region_comm if event.phase == phase]
    replayed = replayed_comm(segment, recompute) if events and phase == "fwd" else []
    return sum(event.time_s for event in events) + sum(event.time_s for event in events if event in replayed)


def replayed_comm(segment: SegmentCost, recompute: str) -> list[CommEvent]:
    """The forward collectives recomputation runs again in backward: a full recompute every one,
    the "op" mode those whose outputs it does not keep (all but the reducing ones),
    "modules:<kinds>" those that bring the inputs of the ops it runs again (the same policy)."""
    if is_modules_mode(recompute):
        return list(segment.modules_recompute_comm(recompute))
    if recompute in ("full", "op"):
        return [event for event in segment.comm
                if event.phase == "fwd" and (recompute == "full" or event.op not in _REDUCING)]
    return []


def recompute_comm_s(segment: SegmentCost, recompute: str, records: list[Windowed] | None = None) -> dict[str, float]:
    """Collectives run again in backward, by breakdown key (tp.<key>): those recomputation replays
    (replayed_comm); the regathering modes gather their sharded saves again. `records` gets each
    replay as tp_windows.windowed keeps it (a re-gather without a window)."""
    extra: dict[str, float] = {}
    for event in replayed_comm(segment, recompute):
        for key, seconds in _event_terms(event):
            extra[key] = extra.get(key, 0.0) + seconds
        if records is not None:
            records.append(windowed(event))
    if recompute in REGATHER_MODES:
        kept = segment.selective_kept if recompute == "selective" else None
        seconds = segment.regather_s(kept)
        if seconds:
            extra["all_gather.regather"] = seconds
    return extra


def _activation_bytes(segment: SegmentCost, recompute: str) -> float:
    if recompute == "full":
        return segment.input_bytes
    if recompute == "selective":
        return segment.regathered_saved_bytes(segment.selective_kept)
    if recompute == "op":
        return segment.op_saved_bytes
    if is_modules_mode(recompute):
        return segment.modules_saved_bytes(recompute)
    if recompute == "gathers":
        return segment.regathered_saved_bytes()
    return segment.saved_bytes


def _event_terms(event: CommEvent) -> list[tuple[str, float]]:
    """An event's seconds by breakdown key (tp.<key>): the collective's in its column, the runtime's
    copy around it (CommEvent.copy_s) in its own, "layout_copy.gather" after an all-gather,
    "layout_copy.scatter" before a reduce-scatter."""
    terms = [(event.column, event.time_s - event.copy_s)]
    if event.copy_s:
        terms.append(("layout_copy.gather" if event.op == "all_gather" else "layout_copy.scatter", event.copy_s))
    return terms


def _add_event(columns: dict[str, np.ndarray], event: CommEvent, index: int, length: int,
               records: list[Windowed]) -> None:
    for key, seconds in _event_terms(event):
        _column(columns, key, length)[index] += seconds
    records.append(windowed(event))


def _caps(records: Sequence[Sequence[Windowed]], comm: dict[str, np.ndarray],
          speedups: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """PreparedSegments.overlap_caps_s from the segments' records: per column, the hideable seconds
    of its windowed collectives plus, uncapped, the rest of the column (a re-gather's seconds)."""
    caps = {op: values.copy() for op, values in comm.items()}
    for index, segment in enumerate(records):
        for record in segment:
            if record[2] is not None and record[0] in caps:
                caps[record[0]][index] -= record[1] - hideable_s(record, speedups)
    return caps


def _column(columns: dict[str, np.ndarray], name: str, length: int) -> np.ndarray:
    """columns[name], made zero when missing (setdefault would build the zeros every call)."""
    column = columns.get(name)
    if column is None:
        column = columns[name] = np.zeros(length)
    return column

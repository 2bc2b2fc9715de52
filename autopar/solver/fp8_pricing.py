"""Prices precision "fp8": what torchao's float8 linears add to and take from a step.

Terms (each named in the plan's breakdown; hardware figures from cost_model/fp8.py):

- `fp8.matmul`: the chosen linears' matmuls at the device's fp8 rate, or their bytes' time where
  longer (`_matmul_bytes`). The segments the step model prices already hold them in place of the
  bf16 ones (fp8_segments.py: the stage cut, the bubble and what compute hides of the collectives
  follow); the term names that share of `compute`. Where the device emulates float8 (CPUs) the
  matmuls stay in `compute` at the bf16 rate.
- `fp8.cast`: the casts as the choice's handling runs them for its recipe (autopar's runtime:
  compiled or eager torchao, cost_model/fp8.py HANDLINGS: eager, six per linear and microbatch, two
  fewer for weights FSDP2 gathers in float8; compiled, the forward-backward graph's identical casts
  once), from each rank's share of the operands under the plan's placements, with the backward's
  float8 layout copies; with FSDP2's float8 all-gather, the cast of each weight shard before every
  gather.
- `fp8.amax`: (delayed scaling, "te": one all-reduce of the step's amaxes over tp) tensorwise
  scaling of a tensor sharded over tp is an amax all-reduce across the tp
  ranks per cast (rowwise: one scale per row, all-reduced when the row is split); FSDP2's float8
  gather adds one all-reduce of every weight's amax per step (the scales precomputed).
- FSDP2 gathers the float8 weights at 1 byte per element instead of the compute dtype's 2: the
  exposed `dp.all_gather` terms shrink by their bytes' share (a note says so).
- memory `fp8.copies`: the float8 copies alive around one linear's matmuls; `fp8.weights`: the
  float8 weights a handling keeps through the step (TE); `fp8.saved_inputs` (negative): TE saves
  the linears' float8 inputs for backward, not the bf16 ones (without recomputation). What a float8 linear
  saves for backward is the high-precision input and weight (torchao saves those, not the float8
  copies), as a bf16 linear does: nothing to add.

A note ("fp8 buys: ...", shown by `autopar explain`) sums the terms: what float8 saves or costs
against the same configuration in bf16.

The other terms are added to the estimate after its stages are laid out: per stage a 1/pp share
of the linears, paid by each of the m + b microbatch slots of the pipeline's critical path, b the
estimate's bubble in stage microbatch times (pp - 1 under 1F1B, (pp - 1) / v interleaved; 0
without a pipeline); under full recomputation the forward's casts and matmuls run twice. The
experts' grouped matmuls (fp8_experts.py) are priced so too, in place of their bf16 time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar.errors import ConfigError
from autopar.graph import OpGraph
from autopar.mesh import Mesh
from autopar.solver.configs import Estimate, ParallelConfig
from autopar.solver.experts import DEFAULT_LOAD_IMBALANCE
from autopar.solver.fp8 import Fp8Choice, linear_weights
from autopar.solver.fp8_experts import Fp8ExpertPricing, PricedExpert
from autopar.solver.recompute_blocks import RecomputedBlocks, is_blocks_mode
from autopar.solver.step_tail import tp_group, uses_fsdp
from cost_model import fp8 as fp8_cost
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel

ROWWISE_UNDER_TP_NOTE = ("fp8: rowwise under tensor parallelism is priced as without it, but torchtitan measured it at "
                         "bf16's speed there (TP 8, June 2025: torchtitan#1207, whose cause torchao#2410 found in the "
                         "small k and v projections, about 40% slower in rowwise float8 than in bf16, a GEMM shape "
                         "autopar does not price; docs/accuracy.md#async-tp): tensorwise is the measured choice with "
                         "tp > 1, or keep such linears in bf16 with fp8_filter (torchao's _auto_filter_for_recipe)")
"""A plan's note where rowwise float8 runs under tp > 1: the one recipe and layout a measurement
contradicts, by a mechanism (rowwise GEMMs of small dims) the cost model does not hold
(benchmarks/published_fp8.py's left-out rows)."""

COMPUTE_BYTES = 2
"""The bf16 activations, weight copies and gradients the casts read."""
MASTER_BYTES = 4
"""fp32 master weight shards (what FSDP2's float8 gather casts)."""


def _float8_saved_input_share(graph: OpGraph, float8_nodes: set[str]) -> float:
    """Bytes of the tensors saved for backward that only float8 linears save (their inputs), over
    all saved bytes (OpGraph.saved_activation_bytes: each storage once)."""
    total = graph.saved_activation_bytes()
    if not total or not float8_nodes:
        return 0.0
    savers: dict[str, set[str]] = {}
    for node in graph.calls():
        sources = [node.inputs[index] for index in node.saved_inputs] + ([node.name] if node.saved_output else [])
        for source in sources:
            root = graph.storage_root(source)
            if graph[root].kind == "call":
                savers.setdefault(root, set()).add(node.name)
    only_float8 = [root for root, nodes in savers.items() if nodes <= float8_nodes]
    return sum(graph[root].output.nbytes for root in only_float8) / total


def _matmul_bytes(elements: fp8_cost.Fp8LinearElements, writes: str) -> tuple[float, float]:
    """(bf16, float8) bytes one of a linear's three matmuls moves: each reads two of the input, the
    weight and the output (or their gradients) and writes the third (`writes`: "output",
    "grad_input", "grad_weight"); in float8 the two it reads are one byte per element, what it
    writes stays in the compute dtype."""
    operands = elements.input + elements.weight + elements.grad_output
    written = {"output": elements.grad_output, "grad_input": elements.input, "grad_weight": elements.weight}[writes]
    return COMPUTE_BYTES * operands, fp8_cost.FP8_BYTES * operands + (COMPUTE_BYTES - fp8_cost.FP8_BYTES) * written


def _on_tensor_cores(graph: OpGraph, name: str) -> bool:
    node = graph[graph.storage_root(name)]
    return node.kind == "call" and any(kernel.is_matmul for kernel in node.fwd_kernels)


def _is_norm(graph: OpGraph, name: str) -> bool:
    node = graph[name]
    return node.kind == "call" and ("rms_norm" in node.target or "layer_norm" in node.target)


@dataclass(frozen=True, kw_only=True)
class _Linear:
    node: str
    source: str
    """The node whose output is the linear's input."""
    after_norm: bool
    """The input is a normalization's output (rms_norm, layer_norm)."""
    after_tensor_cores: bool
    """The input is (a view of) the output of an op that runs on tensor cores (attention, a matmul):
    its backward is an extern kernel that cannot take in a pointwise rescale of the grad_input."""
    fqn: str
    weight_numel: float
    input_per_sample: float
    output_per_sample: float
    in_features: int
    out_features: int
    matmul_flops_per_sample: tuple[tuple[float, str, bool], ...]
    """(FLOPs per sample, dtype, forward) of each matmul kernel."""


@dataclass(frozen=True, kw_only=True)
class _MatmulTimes:
    """One linear's matmul seconds per run and microbatch, by matmul ("output", "grad_input",
    "grad_weight"), in bf16 and in float8; the forward runs `runs` times (2 under full
    recomputation). All zeros where the device emulates float8 (the bf16 time stays in `compute`)."""

    bf16: dict[str, float]
    fp8: dict[str, float]
    runs: int

    def _total(self, times: dict[str, float]) -> float:
        return self.runs * times["output"] + times["grad_input"] + times["grad_weight"]

    @property
    def bf16_s(self) -> float:
        return self._total(self.bf16)

    @property
    def fp8_s(self) -> float:
        return self._total(self.fp8)

    @property
    def bf16_again_s(self) -> float:
        """Of bf16_s: the forward matmuls run again under full recomputation (in `recompute`)."""
        return (self.runs - 1) * self.bf16["output"]

    @property
    def fp8_again_s(self) -> float:
        return (self.runs - 1) * self.fp8["output"]

    @property
    def change_s(self) -> dict[str, float]:
        """fp8 minus bf16 seconds of one run of each matmul."""
        return {role: self.fp8[role] - self.bf16[role] for role in self.bf16}


@dataclass(frozen=True, kw_only=True)
class _Priced:
    """One linear's float8 prices per microbatch on one rank."""

    linear: _Linear
    elements: fp8_cost.Fp8LinearElements
    matmuls: _MatmulTimes
    cast_s: float
    amax_s: float
    kept: bool


class Fp8Pricing:
    """The fp8 terms of one planner's estimates."""

    def __init__(self, graph: OpGraph, choice: Fp8Choice, *, compute: ComputeModel, comm: CommModel,
                 devices_per_node: int, memory_budget_bytes: float, auto: bool = False,
                 load_imbalance: float = DEFAULT_LOAD_IMBALANCE) -> None:
        self.choice = choice
        self.graph = graph
        if choice.handling not in fp8_cost.HANDLINGS:
            raise ConfigError(f"fp8 cast handling {choice.handling!r} is not one of {sorted(fp8_cost.HANDLINGS)}: "
                             "pick one (\"compiled\" and \"eager\" are autopar's runtime)")
        self.handling = fp8_cost.HANDLINGS[choice.handling].for_recipe(choice.recipe)
        """How the casts run: "compiled" or "eager" for autopar's runtime (cost_model/fp8.py HANDLINGS),
        as they run the choice's recipe."""
        self.auto = auto
        """Keep only the linears whose float8 run is priced faster (the planner's choice)."""
        self.recomputed_blocks = RecomputedBlocks(graph.segments)
        """The segments "blocks:<N>" recomputes, for the linears' and experts' forward run again."""
        self.experts = Fp8ExpertPricing(graph, choice.experts, compute=compute, load_imbalance=load_imbalance,
                                        auto=auto, handling=self.handling, recomputed_blocks=self.recomputed_blocks)
        """The float8 expert grouped matmuls' terms (fp8_experts.py)."""
        self.compute = compute
        self.comm = comm
        self.devices_per_node = devices_per_node
        self.memory_budget_bytes = memory_budget_bytes
        chosen = set(choice.linears)
        batch = max(graph.batch_size, 1)
        self.linears: list[_Linear] = []
        for node, fqn, shape in linear_weights(graph):
            if fqn not in chosen:
                continue
            op = graph[node]
            source = graph[op.inputs[0]].output
            kernels = tuple((kernel.flops / batch, kernel.dtype, forward)
                            for forward, group in ((True, op.fwd_kernels), (False, op.bwd_kernels))
                            for kernel in group if kernel.is_matmul)
            self.linears.append(_Linear(node=node, source=op.inputs[0], after_norm=_is_norm(graph, op.inputs[0]),
                                        after_tensor_cores=_on_tensor_cores(graph, op.inputs[0]),
                                        fqn=fqn, weight_numel=float(shape[0] * shape[1]),
                                        input_per_sample=source.numel / batch,
                                        output_per_sample=op.output.numel / batch,
                                        in_features=shape[1], out_features=shape[0], matmul_flops_per_sample=kernels))
        self.saved_input_share = _float8_saved_input_share(graph, {linear.node for linear in self.linears})
        """Of the activations saved for backward: the inputs only float8 linears save (bytes)."""
        self.param_numel = max(float(sum(param.meta.numel for param in graph.params if param.trainable)), 1.0)

    @property
    def lower_bound_factor(self) -> float:
        """No fp8 step is faster than the lower bound of its segments times this (the search's
        pruning must not drop faster fp8 plans): the segments hold the linears' float8 matmuls
        (fp8_segments.py), the experts' grouped matmuls stay bf16 there and may get faster by the
        fp8/bf16 peak ratio."""
        device = self.compute.device
        if not device.has_fp8 or not self.experts.matmuls:
            return 1.0
        return device.peak_flops("bf16") / device.peak_flops("fp8")

    def priced(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict]) -> list[_Priced]:
        """Each chosen linear's float8 prices per microbatch under `config`, and whether it stays
        in float8 (with `auto`: when its float8 matmul, casts and amax all-reduces take less than
        its bf16 matmul)."""
        placements = strategies(config) if config.tp > 1 else {}
        gathered = self.gathers_in_float8(config)
        found, cast_sources = [], set()
        for linear in self.linears:
            elements, sharded = self._elements(linear, config, placements.get(linear.node))
            again = self._recomputed(linear, config)
            times = self._matmul_s(linear, config, elements, sharded["weight"], again)
            # One cast of an input several linears read, where the handling's linears are fused.
            shared = self.handling.shared_input_cast_once and linear.source in cast_sources
            cast_sources.add(linear.source)
            cast_s = self._cast_s(elements, config, gathered, again,
                                  input_on_shard=self._input_gathered_in_float8(linear, config, placements),
                                  input_from_norm=linear.after_norm, input_shared=shared)
            amax_s = self._amax_s(linear, elements, sharded, config, gathered, input_shared=shared)
            kept = not self.auto or times.fp8_s + cast_s + amax_s < times.bf16_s
            found.append(_Priced(linear=linear, elements=elements, matmuls=times, cast_s=cast_s, amax_s=amax_s,
                                 kept=kept))
        return found

    def _recomputed(self, linear: _Linear, config: ParallelConfig) -> bool:
        """Whether the configuration runs this linear's forward again in backward: under "full", and
        under "blocks:<N>" in the blocks it recomputes (solver/recompute_blocks.py)."""
        if not is_blocks_mode(config.recompute):
            return config.recompute == "full"
        return self.recomputed_blocks.holds(linear.node, mode=config.recompute, split=config.pipeline_split,
                                            num_chunks=config.num_chunks)

    def chosen(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict]) -> tuple[str, ...]:
        """Weight FQNs of the linears that run in float8 under `config` (sorted)."""
        return tuple(sorted(item.linear.fqn for item in self.priced(config, strategies) if item.kept))

    def chosen_experts(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict]) -> tuple[str, ...]:
        """Expert weight FQNs whose grouped matmuls run in float8 under `config` (sorted)."""
        return self.experts.chosen(config, strategies)

    def apply(self, estimate: Estimate, strategies: Callable[[ParallelConfig], dict]) -> Estimate:
        """`estimate` (priced on segments whose compute holds the kept linears' float8 matmuls,
        fp8_segments.py) with those matmuls named (`fp8.matmul`), their casts, amax reductions and
        float8 gathers added, the experts' grouped matmuls at the fp8 rate in place of the bf16
        ones, and the memory float8 adds and saves."""
        config = estimate.config
        kept = [item for item in self.priced(config, strategies) if item.kept]
        held_weight = sum(item.elements.weight for item in kept)
        bubble_slots = self._bubble_slots(estimate)
        slots = config.num_microbatches + bubble_slots
        breakdown = dict(estimate.breakdown_s)
        notes = estimate.notes
        if self.auto and len(kept) < len(self.linears):
            notes += (f"fp8: {len(kept)} of {len(self.linears)} eligible linears run in float8 (the others' casts "
                      "would cost more than their faster matmuls save)",)
        terms = self._cast_terms(kept, config, slots, held_weight)
        notes += self._gather_step_terms(kept, config, strategies, breakdown, terms, held_weight)
        matmuls = self._matmul_terms(kept, estimate, breakdown, bubble_slots)
        experts = [item for item in self.experts.priced(config, strategies) if item.kept]
        notes += self._expert_terms(experts, estimate, breakdown, terms, slots, bubble_slots)
        breakdown.update({name: seconds for name, seconds in terms.items()
                          if seconds and name.startswith("fp8.")})
        compared = dict(terms)
        for name, seconds in matmuls.items():
            compared[name] = compared.get(name, 0.0) + seconds
        bf16_step_s = estimate.step_time_s - sum(matmuls.values())
        notes += (self._what_fp8_buys(kept, compared, bf16_step_s, experts),)
        if kept and self.choice.recipe == "rowwise" and config.tp > 1:
            notes += (ROWWISE_UNDER_TP_NOTE,)
        memory, peak = self._memory(kept, experts, estimate, held_weight)
        return replace(estimate, step_time_s=estimate.step_time_s + sum(terms.values()), breakdown_s=breakdown,
                       memory_bytes=memory, peak_memory_bytes=peak, notes=notes,
                       fits=estimate.fits and peak <= self.memory_budget_bytes)

    def _cast_terms(self, kept: list[_Priced], config: ParallelConfig, slots: float,
                    held_weight: float) -> dict[str, float]:
        """`fp8.cast` and `fp8.amax` per step: each microbatch's (and bubble slot's) casts and amax
        reductions (delayed scaling's: each model chunk's, `_region_amax_s`), and the weights'
        casts once per step where the handling keeps them."""
        per_microbatch = {"fp8.cast": sum(item.cast_s for item in kept), "fp8.amax": sum(item.amax_s for item in kept)}
        terms = {name: seconds * slots / config.pp for name, seconds in per_microbatch.items()}
        once = fp8_cost.weight_casts_per_step(self.handling)
        if once and kept:  # weights cast on the step's first microbatch only, a stage's share each
            terms["fp8.cast"] += fp8_cost.cast_time_s(
                once * held_weight / config.pp, once * len(kept), source_bytes=COMPUTE_BYTES,
                bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s, kernel_overhead_s=self.compute.overhead_s,
                handling=self.handling)
        if self.handling.amax_reduced_per_region and kept:
            terms["fp8.amax"] += slots * self._region_amax_s(len(kept), config)
        return terms

    def _region_amax_s(self, linears: int, config: ParallelConfig) -> float:
        """Delayed scaling's amax all-reduces per microbatch on one rank (CastHandling.
        amax_reduced_per_region): each model chunk on the rank reduces its forward casts' amaxes at
        the chunk's end and its backward casts' in its backward, blocking, over the stage's
        tp x dp x cp ranks; `linears`: the float8 linears of the whole model on a tp rank."""
        group = Mesh(axis_names=("pp", "amax"), shape=(config.pp, config.data_shards * config.tp),
                     devices_per_node=self.devices_per_node).group(1)
        if group.num_devices <= 1:
            return 0.0
        chunks = config.chunks_per_device
        per_chunk = linears / (config.pp * chunks)
        seconds = 0.0
        for casts in (self.handling.forward_casts, self.handling.backward_casts):
            amaxes = sum(count for _, count in casts) * per_chunk
            seconds += self.comm.time_s("all_reduce", fp8_cost.SCALE_BYTES * amaxes, group)
        return chunks * seconds

    def _gather_step_terms(self, kept: list[_Priced], config: ParallelConfig,
                           strategies: Callable[[ParallelConfig], dict], breakdown: dict[str, float],
                           terms: dict[str, float], held_weight: float) -> tuple[str, ...]:
        """Adds the float8 gathers to `terms` (FSDP2's weights at 1 byte per element, and the
        sequence-parallel inputs where the handling gathers them in float8); their notes."""
        notes: tuple[str, ...] = ()
        if self.gathers_in_float8(config) and kept:
            terms.update(self._gather_terms(config, held_weight / config.pp, len(kept)))
            share = sum(item.linear.weight_numel for item in kept) / self.param_numel
            saved = self._gather_saving(breakdown, share)
            terms["dp.all_gather"] = -saved  # already in the step time: only its change is added
            if saved:
                notes += (f"fp8: FSDP2 gathers {len(kept)} float8 weights at 1 byte per element; "
                          f"dp.all_gather priced {saved:.3g} s lower",)
        if self.handling.tp_input_gather_in_float8 and kept:
            notes += self._float8_tp_gathers(config, strategies, {item.linear.node for item in kept}, breakdown, terms)
        return notes

    @staticmethod
    def _matmul_terms(kept: list[_Priced], estimate: Estimate, breakdown: dict[str, float],
                      bubble_slots: float) -> dict[str, float]:
        """Names the kept linears' float8 matmuls, which the estimate's compute already holds
        (`recompute` the recomputed forward's; fp8_segments.py): `fp8.matmul` takes them out of
        `compute`, the step unchanged. Returns what they changed against bf16, by term, for the
        note (`_what_fp8_buys`): the float8 matmuls, the bf16 ones they replaced and the bubble's
        share of the difference."""
        config = estimate.config
        matmuls = [item.matmuls for item in kept]
        bf16_matmul_s, fp8_matmul_s = sum(item.bf16_s for item in matmuls), sum(item.fp8_s for item in matmuls)
        if not fp8_matmul_s:
            return {}
        recomputed = "recompute" in estimate.breakdown_s
        again_s = sum(item.fp8_again_s for item in matmuls) if recomputed else 0.0
        bf16_again_s = sum(item.bf16_again_s for item in matmuls) if recomputed else 0.0
        m, pp = config.num_microbatches, config.pp
        breakdown["compute"] = max(breakdown.get("compute", 0.0) - m * (fp8_matmul_s - again_s) / pp, 0.0)
        if again_s:
            breakdown["recompute"] = max(breakdown["recompute"] - m * again_s / pp, 0.0)
        breakdown["fp8.matmul"] = m * fp8_matmul_s / pp
        return {"fp8.matmul": m * fp8_matmul_s / pp, "compute": -m * (bf16_matmul_s - bf16_again_s) / pp,
                "recompute": -m * bf16_again_s / pp, "bubble": bubble_slots * (fp8_matmul_s - bf16_matmul_s) / pp}

    def _memory(self, kept: list[_Priced], experts: list[PricedExpert], estimate: Estimate,
                held_weight: float) -> tuple[dict[str, float], float]:
        """(memory by term, peak): the float8 copies alive around one matmul, the weights' float8
        copies the handling keeps, and what saving float8 inputs takes from the activations."""
        config = estimate.config
        copies = max([fp8_cost.transient_bytes(item.elements) for item in kept]
                     + [item.transient_bytes for item in experts], default=0.0)
        held_weight += sum(item.weight_elements for item in experts)  # a framework's expert linears' (fp8_experts.py)
        weights = fp8_cost.held_weight_bytes(held_weight / config.pp, self.handling)
        saved = 0.0
        if self.handling.saves_float8_inputs and kept and (config.recompute in ("none", "gathers")
                                                           or is_blocks_mode(config.recompute)):
            share = self.saved_input_share * len(kept) / max(len(self.linears), 1)
            saved = estimate.memory_bytes.get("activations", 0.0) * share * (1 - fp8_cost.FP8_BYTES / COMPUTE_BYTES)
        memory = {**estimate.memory_bytes, **({"fp8.copies": copies} if copies else {}),
                  **({"fp8.weights": weights} if weights else {}), **({"fp8.saved_inputs": -saved} if saved else {})}
        return memory, estimate.peak_memory_bytes + copies + weights - saved

    def _expert_terms(self, experts: list[PricedExpert], estimate: Estimate, breakdown: dict[str, float],
                      terms: dict[str, float], slots: float, bubble_slots: float) -> tuple[str, ...]:
        """Adds the float8 expert grouped matmuls' terms (fp8_experts.py) to `terms` and takes their
        bf16 matmuls out of `breakdown`; the notes on the experts that stay bf16."""
        config = estimate.config
        m, pp = config.num_microbatches, config.pp
        notes = self._experts_in_bf16_notes(experts)
        if not experts:
            return notes
        for name, seconds in (("fp8.cast.experts", sum(item.cast_s for item in experts)),
                              ("fp8.copy.experts", sum(item.copy_s for item in experts))):
            if seconds:
                terms[name] = seconds * slots / pp
        once_s = sum(item.weight_once_s for item in experts)  # weights cast on the step's first microbatch
        if once_s:
            terms["fp8.cast.experts"] = terms.get("fp8.cast.experts", 0.0) + once_s / pp
        bf16_s, fp8_s = sum(item.bf16_s for item in experts), sum(item.fp8_s for item in experts)
        extra_s = sum(item.bf16_imbalance_s for item in experts)
        again_s = sum(item.bf16_again_s for item in experts) if "recompute" in breakdown else 0.0
        if not fp8_s:
            return notes
        changes = {"compute": -m * (bf16_s - again_s) / pp, "recompute": -m * again_s / pp,
                   "ep.load_imbalance": -m * extra_s / pp if "ep.load_imbalance" in breakdown else 0.0}
        if not changes["ep.load_imbalance"]:  # no load-imbalance term to take it from: it is in compute
            changes["compute"] -= m * extra_s / pp
        for name, seconds in changes.items():
            if seconds:
                before = breakdown.get(name, 0.0)
                breakdown[name] = before + seconds if before + seconds > 1e-9 * before else 0.0  # all of it: 0
                terms[name] = terms.get(name, 0.0) + breakdown[name] - before
        terms["fp8.matmul.experts"] = m * fp8_s / pp
        if bubble_slots:
            bubble_s = bubble_slots * (fp8_s - bf16_s - extra_s) / pp
            breakdown["bubble"] = max(breakdown["bubble"] + bubble_s, 0.0)
            terms["bubble"] = terms.get("bubble", 0.0) + bubble_s
        return notes

    def _experts_in_bf16_notes(self, experts: list[PricedExpert]) -> tuple[str, ...]:
        """What `autopar explain` says of expert weights whose grouped matmuls stay bf16."""
        reasons: dict[str, list[str]] = {}
        for fqn, why in self.choice.experts_in_bf16:
            reasons.setdefault(why, []).append(fqn)
        kept = {item.matmul.fqn for item in experts}
        slower = sorted({matmul.fqn for matmul in self.experts.matmuls} - kept)
        if slower:
            reasons["their float8 casts and copies would cost more than their faster grouped matmuls save"] = slower
        return tuple(f"fp8: {len(names)} expert weights' grouped matmuls stay bf16: {why} ({', '.join(names[:4])}"
                     f"{', ...' if len(names) > 4 else ''})" for why, names in reasons.items())

    def _what_fp8_buys(self, kept: list[_Priced], terms: dict[str, float], bf16_step_s: float,
                       experts: list[PricedExpert] = ()) -> str:
        """The note `autopar explain` shows: the step's change from float8, term by term."""
        head = (f"fp8 buys: {len(kept)} of {len(self.linears)} eligible linears in float8 ({self.choice.recipe} "
                f"scaling, {self.choice.handling} casts)")
        if self.experts.matmuls:
            total = len({matmul.fqn for matmul in self.experts.matmuls}) + len(self.choice.experts_in_bf16)
            head += (f", {len({item.matmul.fqn for item in experts})} of {total} expert weights' grouped matmuls "
                     "in float8 (rowwise)")
        if not kept and not experts:
            if not self.linears and not self.experts.matmuls:
                why = ("no linear is eligible (torchao's rule: a trainable 2-D weight with both dims multiples of 16, "
                       "not the output head nor tied to an embedding)")
            elif self.auto:
                why = "each one's casts and amax reductions would cost more than its float8 matmuls save"
            else:
                why = "no linear is chosen"
            return f"{head}: nothing, {why}; the step runs in bf16"
        change_s = sum(terms.values())
        replaced = ("compute", "recompute", "ep.load_imbalance")
        replaced_s = -sum(terms.get(name, 0.0) for name in replaced)
        float8_s = terms.get("fp8.matmul", 0.0) + terms.get("fp8.matmul.experts", 0.0)
        matmul = (f"matmuls {float8_s:.3g} s in float8 instead of {replaced_s:.3g} s in bf16, "
                  if float8_s else "matmuls emulated (no FP8 tensor cores), ")
        others = ", ".join(f"{name} {seconds:+.3g} s" for name, seconds in terms.items()
                           if seconds and name not in ("fp8.matmul", "fp8.matmul.experts") + replaced)
        verdict = "saves" if change_s < 0 else "costs"
        return (f"{head}: {matmul}{others or 'nothing else'}; {verdict} "
                f"{abs(change_s):.3g} s per step ({100 * abs(change_s) / max(bf16_step_s, 1e-30):.1f}% of the bf16 "
                "step)")

    def _float8_tp_gathers(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict],
                           float8_nodes: set[str], breakdown: dict[str, float], terms: dict[str, float]) -> tuple:
        """The sequence-parallel inputs of column-parallel float8 linears gathered in float8
        (CastHandling.tp_input_gather_in_float8): `tp.all_gather` (and the copies of the gathered
        tensors into place, `tp.layout_copy.gather`) shrinks by their bytes' share at 1 byte per
        element, and where the handling saves the float8 shard for backward (saves_float8_inputs:
        TE) so does its re-gather in backward (`tp.all_gather.regather`, the "gathers"
        recomputation Megatron runs). Returns the notes."""
        notes = ()
        for term, forward_only in (("tp.all_gather", False), ("tp.layout_copy.gather", False),
                                   ("tp.all_gather.regather", True)):
            if not breakdown.get(term) or (forward_only and not self.handling.saves_float8_inputs):
                continue
            fraction = self._float8_gathered_fraction(config, strategies, float8_nodes, forward_only=forward_only)
            saved = breakdown[term] * fraction * (COMPUTE_BYTES - fp8_cost.FP8_BYTES) / COMPUTE_BYTES
            breakdown[term] -= saved
            terms[term] = -saved
            if saved:
                notes += (f"fp8: the sequence-parallel inputs of column-parallel float8 linears are all-gathered in "
                          f"float8 ({100 * fraction:.0f}% of the {term} bytes at 1 byte per element); "
                          f"{term} priced {saved:.3g} s lower",)
        return notes

    def _float8_gathered_fraction(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict],
                                  float8_nodes: set[str], forward_only: bool = False) -> float:
        """Share of the tp all-gather bytes that are inputs of float8 linears: of the forward's
        gathers (a sharded output read replicated) and the backward's (each forward reduce-scatter,
        a partial output read sharded, gathers its gradient back; not with `forward_only`: the
        share of the forward's gathers, which the backward's re-gathers repeat), those gathered for
        a float8 linear's input, each gathered tensor counted once."""
        placements = strategies(config) if config.tp > 1 else {}
        gathered: dict[str, float] = {}
        scattered: dict[str, float] = {}
        float8_inputs: set[str] = set()
        for node in self.graph.calls():
            strategy = placements.get(node.name)
            inputs = getattr(strategy, "inputs", ())
            for index, source in enumerate(node.inputs):
                producer = placements.get(source)
                if producer is None or index >= len(inputs) or not inputs[index] or not producer.output:
                    continue
                made, read = producer.output[0], inputs[index][0]
                if made.startswith("S") and read == "R":
                    gathered[source] = self.graph[source].output.numel
                    if node.name in float8_nodes and index == 0:
                        float8_inputs.add(source)
                elif made == "P" and read.startswith("S"):
                    scattered[source] = self.graph[source].output.numel
        total = sum(gathered.values()) + (0.0 if forward_only else sum(scattered.values()))
        return sum(gathered[name] for name in float8_inputs) / total if total else 0.0

    @staticmethod
    def _bubble_slots(estimate: Estimate) -> float:
        """The pipeline bubble in microbatch times of a stage: pp - 1 under 1F1B, (pp - 1) / v
        interleaved over v chunks; 0 without a pipeline. The fp8 terms of a microbatch are paid
        by each of the m + this many slots of the critical path. A slot is the slowest stage's
        microbatch time (the step is m of them and the bubble), collectives included."""
        config = estimate.config
        bubble_s = estimate.breakdown_s.get("bubble", 0.0)
        per_microbatch_s = max((stage.time_per_microbatch_s for stage in estimate.stages), default=0.0)
        if config.pp == 1 or bubble_s <= 0 or per_microbatch_s <= 0:
            return 0.0
        return bubble_s / per_microbatch_s

    def gathers_in_float8(self, config: ParallelConfig) -> bool:
        """FSDP gathers the float8 weights (torchao's tensorwise float8 all-gather, where the
        handling does it)."""
        return self.handling.float8_all_gather and self.choice.recipe == "tensorwise" and uses_fsdp(config)

    def _elements(self, linear: _Linear, config: ParallelConfig, strategy) -> tuple:
        """This rank's operand elements per microbatch, and which operands the plan shards over tp."""
        def split(placement: str | None) -> bool:
            return config.tp > 1 and bool(placement) and placement.startswith("S")

        inputs = getattr(strategy, "inputs", ())
        sharded = {"input": split(inputs[0][0] if len(inputs) > 0 and inputs[0] else None),
                   "weight": split(inputs[1][0] if len(inputs) > 1 and inputs[1] else None),
                   "grad_output": split(getattr(strategy, "output", (None,))[0] if strategy is not None else None)}
        samples = config.microbatch_size / config.cp
        elements = fp8_cost.Fp8LinearElements(
            input=linear.input_per_sample * samples / (config.tp if sharded["input"] else 1),
            weight=linear.weight_numel / (config.tp if sharded["weight"] else 1),
            grad_output=linear.output_per_sample * samples / (config.tp if sharded["grad_output"] else 1))
        return elements, sharded

    def _matmul_s(self, linear: _Linear, config: ParallelConfig, elements: fp8_cost.Fp8LinearElements,
                  weight_sharded: bool, again: bool = False) -> _MatmulTimes:
        """This rank's matmul times of one linear per microbatch at the bf16 rate and at the fp8 rate
        (the profile's fp8 sweep, `autopar profile` with torch._scaled_mm, else its bf16 rate
        times the device's float8 speed-up), with the forward's matmuls run again where it is
        recomputed (`again`: _recomputed); no fp8 time where the device has no FP8 tensor cores (emulated: the
        bf16 time stays in `compute`), the forward matmul at the fast-accumulation rate where the
        profile measured it (`_fp8_rate`). Each matmul takes the longer of its FLOPs' time and its
        bytes' (`_matmul_bytes`), as compute prices the bf16 one: a skinny matmul (a tp shard of a
        small projection) is bound by reading its large operand, in float8 at one byte per
        element. Under the rowwise recipe torchao's backward matmuls add their rescale passes
        (CastHandling.rowwise_rescale_bytes)."""
        bf16 = {"output": 0.0, "grad_input": 0.0, "grad_weight": 0.0}
        if not self.compute.device.runs_fp8_matmuls:
            return _MatmulTimes(bf16=bf16, fp8=dict(bf16), runs=1)
        fp8 = dict(bf16)
        bandwidth = self.compute.bandwidth_bytes_per_s
        backward_roles = iter(("grad_input", "grad_weight"))
        for per_sample, dtype, forward in linear.matmul_flops_per_sample:
            flops = per_sample * config.microbatch_size / config.cp / (config.tp if weight_sharded else 1)
            role = "output" if forward else next(backward_roles, "grad_weight")
            if flops <= 0:
                continue
            bf16_bytes, fp8_bytes = _matmul_bytes(elements, role)
            bf16[role] += max(flops / self.compute.matmul_rate(flops, dtype), bf16_bytes / bandwidth)
            fp8_rate = self._fp8_rate(flops, fast=role in fp8_cost.FAST_ACCUMULATION_MATMULS)
            fp8[role] += max(flops / fp8_rate, fp8_bytes / bandwidth)
        if self.choice.recipe == "rowwise":  # the backward matmuls' scales, applied apart
            def rescale_s(output_elements: float) -> float:
                return self.handling.rescale_pass_s(output_elements, bandwidth_bytes_per_s=bandwidth,
                                                    kernel_overhead_s=self.compute.overhead_s)

            fp8["grad_weight"] += rescale_s(elements.weight)  # leaves the compiled graph: always apart
            if not self.handling.rescale_fused_into_consumers or linear.after_tensor_cores:
                fp8["grad_input"] += rescale_s(elements.input)
        return _MatmulTimes(bf16=bf16, fp8=fp8, runs=2 if again else 1)

    def _fp8_rate(self, flops: float, *, fast: bool) -> float:
        """A float8 matmul's FLOP/s: the profile's sweep for its accumulation ("fp8_fast" or split
        "fp8", cost_model/fp8.py FAST_ACCUMULATION_MATMULS), else the bf16 rate times the device's
        documented float8 speed-up (DeviceSpec.fp8_matmul_speedup: the peaks' ratio where none is)."""
        key = "fp8_fast" if fast and self.compute.measured("fp8_fast") else "fp8"
        if self.compute.measured(key):
            return self.compute.matmul_rate(flops, key)
        return self.compute.matmul_rate(flops, "bf16") * self.compute.device.fp8_matmul_speedup

    def _input_gathered_in_float8(self, linear: _Linear, config: ParallelConfig, placements: dict) -> bool:
        """The handling gathers this linear's sequence-parallel input in float8: its forward cast
        runs on the shard before the all-gather (CastHandling.tp_input_gather_in_float8)."""
        if not self.handling.tp_input_gather_in_float8 or config.tp == 1:
            return False
        producer, strategy = placements.get(linear.source), placements.get(linear.node)
        inputs = getattr(strategy, "inputs", ())
        if producer is None or not producer.output or not inputs or not inputs[0]:
            return False
        return producer.output[0].startswith("S") and inputs[0][0] == "R"

    def _cast_s(self, elements, config: ParallelConfig, gathered: bool, again: bool = False,
                input_on_shard: bool = False, input_from_norm: bool = False, input_shared: bool = False) -> float:
        """One linear's casts per microbatch. `again`: its forward runs again in backward (_recomputed);
        `input_from_norm`: its input is a norm's output; `input_shared`: another linear already cast
        that input (CastHandling.shared_input_cast_once)."""
        handling = self.handling
        count = fp8_cost.cast_elements(elements, weight_precast=gathered, handling=handling)
        casts = fp8_cost.num_casts(weight_precast=gathered, handling=handling)
        forward_input = elements.input / config.tp if input_on_shard else elements.input
        one_pass = 0.0  # a norm-fed input whose amax the norm kernel wrote: the cast pass alone
        if input_shared:  # every cast of it is the other linear's
            later = fp8_cost.cast_counts(handling).get("input", 1) - 1
            forward_input, count, casts = 0.0, count - later * elements.input, casts - 1 - later
        elif input_from_norm and handling.norm_fused_input_cast:  # no cast of it here
            forward_input = 0.0
            casts -= 1
        elif input_from_norm and handling.norm_fused_amax:
            one_pass, forward_input = forward_input, 0.0
            casts -= 1
        count -= elements.input - forward_input  # the forward's cast of a float8-gathered input: its shard
        pass_only = elements.weight if handling.weight_recast_pass_only and not gathered else 0.0
        count, casts = count - pass_only, casts - (1 if pass_only else 0)  # the backward's weight: a cast pass
        if again:  # the forward's input (and weight) casts run again
            weight_again = not gathered and not handling.weight_cast_once_per_step
            count += forward_input + (elements.weight if weight_again else 0)
            casts += (1 if forward_input else 0) + (1 if weight_again else 0)
        runs = 2 if again else 1
        one_pass_handling = replace(handling, element_passes="one_pass")
        layouts_s = fp8_cost.layout_copy_time_s(elements, handling, input_shared=input_shared,
                                                bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s,
                                                kernel_overhead_s=self.compute.overhead_s)
        return (self._casts_s(count, casts, handling)
                + self._casts_s(runs * one_pass, runs if one_pass else 0, one_pass_handling)
                + self._casts_s(pass_only, 1 if pass_only else 0, one_pass_handling) + layouts_s)

    def _casts_s(self, elements: float, casts: int, handling: fp8_cost.CastHandling) -> float:
        return fp8_cost.cast_time_s(elements, casts, source_bytes=COMPUTE_BYTES,
                                    bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s,
                                    kernel_overhead_s=self.compute.overhead_s, handling=handling)

    def _amax_s(self, linear: _Linear, elements, sharded: dict, config: ParallelConfig, gathered: bool,
                input_shared: bool = False) -> float:
        """The amax all-reduces over tp of one linear's casts per microbatch (`_amax_counts`), each
        of one scale (tensorwise) or of one scale per row of the operand as the matmul reads it."""
        if config.tp == 1 or self.handling.amax_reduced_per_region:
            return 0.0
        seconds = 0.0
        group = self._tp_group(config)
        for operand, count in self._amax_counts(sharded, gathered, input_shared).items():
            if self.choice.recipe == "tensorwise":
                message = fp8_cost.SCALE_BYTES
            else:  # one scale per row of the operand as the matmul reads it
                width = linear.in_features if operand != "grad_output" else linear.out_features
                message = fp8_cost.SCALE_BYTES * getattr(elements, operand) * config.tp / width
            seconds += count * self.comm.time_s("all_reduce", message, group)
        return seconds

    def _amax_counts(self, sharded: dict, gathered: bool, input_shared: bool) -> dict[str, int]:
        """All-reduced amaxes per operand of one linear per microbatch. torchao: each cast of an
        operand the tp ranks hold parts of (a sharded DTensor's global amax). TE's current scaling
        (CastHandling.amax_on_sequence_shards): a column-parallel linear's input, cast on its
        sequence shard before the float8 gather (once per fused linear), and a row-parallel
        linear's grad_output, which arrives sequence-sharded."""
        if self.handling.amax_on_sequence_shards:
            if sharded["input"]:  # row-parallel
                return {"grad_output": 1}
            return {"input": 0 if input_shared else 1} if sharded["grad_output"] else {}
        casts = fp8_cost.amax_counts(self.handling)
        counts = {"input": 0 if input_shared else casts.get("input", 0),
                  "weight": 0 if gathered else casts.get("weight", 0), "grad_output": casts.get("grad_output", 0)}
        return {operand: count for operand, count in counts.items() if sharded[operand] and count}

    @staticmethod
    def _gather_saving(breakdown: dict[str, float], share: float) -> float:
        """Exposed all-gather time the float8 weights' bytes (`share` of all parameters) no longer
        take; the dp.all_gather terms shrink by it, each by its share."""
        fraction = share * (COMPUTE_BYTES - fp8_cost.FP8_BYTES) / COMPUTE_BYTES
        saved = 0.0
        for name in [name for name in breakdown if name.startswith("dp.all_gather")]:
            saved += breakdown[name] * fraction
            breakdown[name] *= 1.0 - fraction
        return saved

    def _gather_terms(self, config: ParallelConfig, stage_weight: float, num_weights: int) -> dict[str, float]:
        """FSDP2's float8 all-gather: the shard casts before each gather, and the step's one
        all-reduce of the weights' amaxes (the scales precomputed)."""
        shard = stage_weight / config.data_shards  # of a stage's float8 weights (tp shards, 1/pp of them)
        gathers = 2 * config.num_microbatches if config.zero_stage == 3 else 1
        cast = gathers * fp8_cost.cast_time_s(shard, num_weights, source_bytes=MASTER_BYTES,
                                              bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s,
                                              kernel_overhead_s=self.compute.overhead_s, handling=self.handling)
        mesh = Mesh(axis_names=("pp", "dp_cp", "tp"), shape=(config.pp, config.data_shards, config.tp),
                    devices_per_node=self.devices_per_node)
        amax = self.comm.time_s("all_reduce", fp8_cost.SCALE_BYTES * num_weights, mesh.group(1))
        return {"fp8.cast.all_gather": cast, "fp8.amax.precompute": amax}

    def _tp_group(self, config: ParallelConfig):
        return tp_group(config, self.devices_per_node)

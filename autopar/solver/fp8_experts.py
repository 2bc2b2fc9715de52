"""Prices the float8 expert grouped matmuls of precision "fp8" (codegen/fp8_experts.py).

One expert op is a grouped matmul tokens[S, K] x weight[E, K, N] over rows sorted by expert. Per
microbatch on one rank it works on

    rows     R: the op's rows per sample x the microbatch / cp, / tp where the plan splits the rows
             or the experts on tp, or folds the experts (each tp rank routes its own rows); under
             ep the rank's experts get the group's rows for them, R x the load imbalance on the
             busiest rank (solver/experts.py)
    experts  E_local: E (/ tp where split by expert on tp) / ep
    dims     K, N (/ tp where the weight is split along one of them)

Terms (each named in the plan's breakdown):

- `fp8.matmul.experts`: its three grouped matmuls (forward, token gradient, weight gradient) at
  the fp8 rate with the grouped-GEMM efficiency the model gives their per-expert size
  (ComputeModel.grouped_matmul_s: E_local matmuls of R / E_local rows each; a profile's fp8
  grouped sweep where measured, else the bf16 grouped rate x the device's float8 speed-up,
  as the linears' matmuls). They replace the same matmuls at the bf16 rate, which leave `compute`
  (the busiest rank's extra rows: `ep.load_imbalance`; the forward's run again: `recompute`).
  Emulated devices (no FP8 tensor cores) keep the bf16 matmuls in `compute`.
- `fp8.cast.experts`: torchao's rowwise quantization passes (fp8_grouped_mm.py), each a fused
  Triton kernel that reads its bf16 source twice (the row amaxes, then scale and cast) and writes
  float8 (cost_model/fp8.py's "compiled" bytes, 5 per element): forward, tokens (R K) and weight
  (E_local K N); backward, grad_output (R N) and the weight again for the token gradient, then
  grad_output and tokens scaled per expert's rows for the weight gradient (one dual kernel):
  2 R K + 2 R N + 2 E_local K N elements in 5 kernels, the forward's two again where the op is
  recomputed. Emulated: the same elements at torchao's eager element passes.
- `fp8.copy.experts` (FP8 tensor cores: the CUDA path): what autopar's runtime adds around
  torchao's kernels: each expert's rows padded to 16 and back (the tokens scattered into the
  padded rows and the output gathered from them forward, grad_output scattered and the token
  gradient gathered backward: a bf16 read and write each) and the weight copied column-major
  (read and write) forward and again backward (the copy is not saved for the backward).
- memory `fp8.copies`: the copies alive around one op (the larger of the forward's and the
  backward's: float8 operands, the padded bf16 operand and, on the CUDA path, the weight's
  column-major copy), against the linears' (the larger counts).

A published run whose framework runs each expert as a float8 linear of its own
(CastHandling.experts_as_linears: TransformerEngine under Megatron-Core's SequentialMLP or
TEGroupedMLP) is priced as it ran: `fp8.cast.experts` is its linears' casts over the experts'
operands (cost_model/fp8.py: a local expert's rows cast as a linear's input, one cast per expert
and operand, forward and backward as the handling counts them, an input another expert op already
cast not again; the weights cast once per step and kept, memory `fp8.weights`), and there are no
copies (the framework's GEMMs take each expert's rows and weight as they lie).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar.graph import OpGraph
from autopar.solver.configs import ParallelConfig
from autopar.solver.fp8 import expert_weights
from autopar.solver.recompute_blocks import RecomputedBlocks, is_blocks_mode
from autopar.solver.recompute_modules import is_modules_mode, mode_kinds
from cost_model import fp8 as fp8_cost
from cost_model.compute import ComputeModel, is_grouped_matmul

COMPUTE_BYTES = 2
"""bf16 tokens, weights and gradients."""
PAD_PASSES = 2
"""Padding rows: the rows read and written into the padded buffer (only its padding rows zeroed)."""
UNPAD_PASSES = 2
"""Dropping the padding: the rows read and written."""
COPY_PASSES = 2
"""The weight's column-major copy: read and written."""


@dataclass(frozen=True, kw_only=True)
class ExpertMatmul:
    """One grouped expert matmul of the graph chosen to run in float8."""

    node: str
    fqn: str
    num_experts: int
    rows_per_sample: float
    in_features: int
    out_features: int
    flops_per_sample: tuple[tuple[float, bool], ...]
    """(FLOPs per sample, forward) of each of its grouped-matmul kernels."""
    source: str = ""
    """The node its tokens come from (expert ops reading one input share its casts)."""


@dataclass(frozen=True, kw_only=True)
class PricedExpert:
    """One expert op's float8 prices per microbatch on one rank."""

    matmul: ExpertMatmul
    bf16_s: float
    """Its matmuls at the bf16 rate, even load (in `compute`)."""
    bf16_imbalance_s: float
    """The busiest rank's extra bf16 matmul time (in `ep.load_imbalance`)."""
    bf16_again_s: float
    """Of bf16_s: the forward's matmul run again under recomputation (in `recompute`)."""
    fp8_s: float
    cast_s: float
    copy_s: float
    transient_bytes: float
    kept: bool
    weight_once_s: float = 0.0
    """Its weight's casts once per step, where the framework casts them so (experts_as_linears)."""
    weight_elements: float = 0.0
    """Its weight's elements on this rank (the float8 copies such a framework keeps)."""


class Fp8ExpertPricing:
    """The float8 expert terms of one planner's estimates."""

    def __init__(self, graph: OpGraph, fqns: tuple[str, ...], *, compute: ComputeModel, load_imbalance: float,
                 auto: bool = False, handling: fp8_cost.CastHandling | None = None,
                 recomputed_blocks: RecomputedBlocks | None = None) -> None:
        self.compute = compute
        self.handling = handling if handling is not None and handling.experts_as_linears else None
        """The framework's linear casts, where it runs each expert as a float8 linear (module
        docstring); None: torchao's grouped casts and autopar's copies."""
        self.load_imbalance = load_imbalance
        self.auto = auto
        """Keep only the ops whose float8 run is priced faster than bf16 (the planner's choice)."""
        self.recomputed_blocks = recomputed_blocks or RecomputedBlocks(graph.segments)
        """The segments "blocks:<N>" recomputes (shared with Fp8Pricing's linears)."""
        chosen = set(fqns)
        batch = max(graph.batch_size, 1)
        self.matmuls: list[ExpertMatmul] = []
        for node, fqn, shape, kind in expert_weights(graph):
            if fqn not in chosen or kind != "grouped_mm":
                continue
            op = graph[node]
            kernels = tuple((kernel.flops / batch, forward)
                            for forward, group in ((True, op.fwd_kernels), (False, op.bwd_kernels))
                            for kernel in group if kernel.is_matmul and is_grouped_matmul(kernel.name))
            self.matmuls.append(ExpertMatmul(node=node, fqn=fqn, num_experts=shape[0],
                                             rows_per_sample=graph[op.inputs[0]].output.shape[0] / batch,
                                             in_features=shape[1], out_features=shape[2], flops_per_sample=kernels,
                                             source=op.inputs[0]))

    def priced(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict]) -> list[PricedExpert]:
        if not self.matmuls:
            return []
        placements = strategies(config) if config.tp > 1 else {}
        found, sources = [], set()
        for matmul in self.matmuls:
            shared = self.handling is not None and self.handling.shared_input_cast_once and matmul.source in sources
            sources.add(matmul.source)
            found.append(self._priced(matmul, config, placements.get(matmul.node), input_shared=shared))
        return found

    def chosen(self, config: ParallelConfig, strategies: Callable[[ParallelConfig], dict]) -> tuple[str, ...]:
        """Expert weight FQNs whose grouped matmuls run in float8 under `config` (sorted): a weight
        read by several ops runs in float8 when every one is kept."""
        kept: dict[str, bool] = {}
        for item in self.priced(config, strategies):
            kept[item.matmul.fqn] = kept.get(item.matmul.fqn, True) and item.kept
        return tuple(sorted(fqn for fqn, ok in kept.items() if ok))

    def _priced(self, matmul: ExpertMatmul, config: ParallelConfig, strategy,
                input_shared: bool = False) -> PricedExpert:
        rows, experts, k, n, divisor = self._shape(matmul, config, strategy)
        imbalance = self.load_imbalance if config.ep > 1 else 1.0
        again = self._recomputed(matmul, config)
        device = self.compute.device
        ratio = device.fp8_matmul_speedup
        tensor_cores = device.runs_fp8_matmuls
        bf16_s = extra_s = again_s = fp8_s = 0.0
        for per_sample, forward in matmul.flops_per_sample:
            flops = per_sample * config.microbatch_size / config.cp / divisor
            runs = 2 if forward and again else 1
            even = self.compute.grouped_matmul_s(flops, flops / experts, "bf16")
            busiest = self.compute.grouped_matmul_s(flops * imbalance, flops * imbalance / experts, "bf16")
            bf16_s += runs * even
            extra_s += runs * (busiest - even)
            again_s += (runs - 1) * even
            fp8_s += runs * self._fp8_s(flops * imbalance, experts, ratio)
        token_elements, grad_elements, weight_elements = rows * imbalance * k, rows * imbalance * n, experts * k * n
        if self.handling is not None and tensor_cores:  # the framework's linears (module docstring)
            elements = fp8_cost.Fp8LinearElements(input=token_elements, weight=weight_elements,
                                                  grad_output=grad_elements)
            priced = PricedExpert(matmul=matmul, bf16_s=bf16_s, bf16_imbalance_s=extra_s, bf16_again_s=again_s,
                                  fp8_s=fp8_s, cast_s=0.0, copy_s=0.0, transient_bytes=0.0, kept=True)
            return self._as_linears(priced, elements, experts, config, again, input_shared)
        casts = 2 * token_elements + 2 * grad_elements + 2 * weight_elements
        kernels = 5
        if again:  # the forward's tokens and weight cast again
            casts += token_elements + weight_elements
            kernels += 2
        handling = fp8_cost.HANDLINGS["compiled" if tensor_cores else "eager"]
        cast_s = fp8_cost.cast_time_s(casts, kernels, source_bytes=COMPUTE_BYTES,
                                      bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s,
                                      kernel_overhead_s=self.compute.overhead_s, handling=handling)
        copy_s = self._copy_s(token_elements, grad_elements, weight_elements, again) if tensor_cores else 0.0
        copy = weight_elements * COMPUTE_BYTES if tensor_cores else 0.0  # the column-major weight
        forward_bytes = (token_elements + weight_elements) * fp8_cost.FP8_BYTES + token_elements * COMPUTE_BYTES + copy
        backward_bytes = (2 * grad_elements + token_elements + weight_elements) * fp8_cost.FP8_BYTES \
            + grad_elements * COMPUTE_BYTES + copy
        if not tensor_cores:  # no float8 matmul: the matmuls stay in compute
            bf16_s = extra_s = again_s = fp8_s = 0.0
        kept = not self.auto or fp8_s + cast_s + copy_s < bf16_s + extra_s
        return PricedExpert(matmul=matmul, bf16_s=bf16_s, bf16_imbalance_s=extra_s, bf16_again_s=again_s,
                            fp8_s=fp8_s, cast_s=cast_s, copy_s=copy_s,
                            transient_bytes=max(forward_bytes, backward_bytes), kept=kept)

    def _as_linears(self, priced: PricedExpert, elements: fp8_cost.Fp8LinearElements, experts: int,
                    config: ParallelConfig, again: bool, input_shared: bool) -> PricedExpert:
        """`priced` (its matmul times) with the casts of a framework running each expert as a float8
        linear, no copies, and the float8 copies alive around its matmuls."""
        cast_s, weight_once_s = self._linear_casts_s(elements, experts, again, input_shared)
        kept = not self.auto or (priced.fp8_s + cast_s + weight_once_s / config.num_microbatches
                                 < priced.bf16_s + priced.bf16_imbalance_s)
        return replace(priced, cast_s=cast_s, weight_once_s=weight_once_s, weight_elements=elements.weight,
                       transient_bytes=fp8_cost.transient_bytes(elements), kept=kept)

    def _linear_casts_s(self, elements: fp8_cost.Fp8LinearElements, experts: int, again: bool,
                        input_shared: bool) -> tuple[float, float]:
        """(per microbatch, once per step) seconds of one expert op's casts as the framework casts a
        linear's operands, one cast per local expert and operand: the input (unless another expert
        op cast it; again where the forward is recomputed) and grad_output each microbatch, the
        weight once per step where the handling keeps it (else each microbatch)."""
        handling = self.handling
        counts = fp8_cost.cast_counts(handling)
        once = fp8_cost.weight_casts_per_step(handling)
        if once:
            counts.pop("weight", None)
        if input_shared:
            counts.pop("input", None)
        elif again:
            counts["input"] = counts.get("input", 0) + dict(handling.forward_casts).get("input", 0)
        cast_elements = sum(count * getattr(elements, operand) for operand, count in counts.items())

        def seconds(count: float, casts: int) -> float:
            return fp8_cost.cast_time_s(count, casts * experts, source_bytes=COMPUTE_BYTES,
                                        bandwidth_bytes_per_s=self.compute.bandwidth_bytes_per_s,
                                        kernel_overhead_s=self.compute.overhead_s, handling=handling)
        return seconds(cast_elements, sum(counts.values())), seconds(once * elements.weight, once)

    def _fp8_s(self, flops: float, experts: int, ratio: float) -> float:
        if flops <= 0:
            return 0.0
        if self.compute.measured_grouped("fp8"):
            return self.compute.grouped_matmul_s(flops, flops / experts, "fp8")
        return self.compute.grouped_matmul_s(flops, flops / experts, "bf16") / ratio

    def _copy_s(self, token_elements: float, grad_elements: float, weight_elements: float, again: bool) -> float:
        runs = 2 if again else 1
        passes = (runs * (PAD_PASSES * token_elements + UNPAD_PASSES * grad_elements)  # forward: tokens in, output out
                  + PAD_PASSES * grad_elements + UNPAD_PASSES * token_elements  # backward: grad in, token grad out
                  + (runs + 1) * COPY_PASSES * weight_elements)  # forward (again if recomputed) and backward
        kernels = runs * 3 + 4
        return passes * COMPUTE_BYTES / self.compute.bandwidth_bytes_per_s + kernels * self.compute.overhead_s

    @staticmethod
    def _shape(matmul: ExpertMatmul, config: ParallelConfig, strategy) -> tuple[float, int, float, float, int]:
        """(rows, local experts, K, N, the tp divisor of its FLOPs) on one rank (module docstring)."""
        inputs = getattr(strategy, "inputs", ())
        tokens = inputs[0][0] if len(inputs) > 0 and inputs[0] else "R"
        weight = inputs[1][0] if len(inputs) > 1 and inputs[1] else "R"
        tp = config.tp
        rows = matmul.rows_per_sample * config.microbatch_size / config.cp
        experts, k, n, divisor = matmul.num_experts, float(matmul.in_features), float(matmul.out_features), 1
        if config.folds_experts:
            rows, divisor = rows / tp, tp
        elif tp > 1:
            if tokens.startswith("S0") or weight == "S0":
                rows, divisor = rows / tp, tp
            if weight == "S0":
                experts = max(experts // tp, 1)
            elif weight == "S1":
                k, divisor = k / tp, tp
            elif weight == "S2":
                n, divisor = n / tp, tp
        return rows, max(experts // max(config.ep, 1), 1), k, n, divisor

    def _recomputed(self, matmul: ExpertMatmul, config: ParallelConfig) -> bool:
        """The op's forward runs again in backward (full recomputation, recomputed MoE modules, or
        under "blocks:<N>" in a block it recomputes: solver/recompute_blocks.py)."""
        mode = config.recompute
        if is_blocks_mode(mode):
            return self.recomputed_blocks.holds(matmul.node, mode=mode, split=config.pipeline_split,
                                                num_chunks=config.num_chunks)
        return mode == "full" or (is_modules_mode(mode) and "moe" in mode_kinds(mode))


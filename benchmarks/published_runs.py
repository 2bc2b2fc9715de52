"""Published, measured training runs (shared/reference/published_runs.csv, and the bf16 runs of
benchmarks/published_bf16.csv beyond that sample) against autopar's prediction of the same
configuration.

    .venv/bin/python benchmarks/published_runs.py [--rows kor-22b-sel,tt-8b-fsdp-8] [--breakdown] [--classes]
        [--compile-gain] [--ran]

Each row's model, cluster (with the figures the source states, as a cluster TOML) and
configuration (tp, pp, dp, microbatch, interleaving, ZeRO/FSDP stage, recomputation) is priced
with `Planner.evaluate`, exactly as `autopar evaluate` would; the prediction is converted to the
source's unit (step time, tokens/s per GPU, or TFLOP/s per GPU by the formula the row names) and,
where the source measured memory ("NN GiB used" in its notes), the predicted peak is shown
beside it. The reference numbers are only read here, to compare; the product never sees them.

Tensor parallelism is priced as the run had it: where the notes say "TP without SP" (or "without
sequence parallelism"), with `sequence_parallel=False` (norms, dropouts, residual adds replicated
on the tp ranks, row-parallel outputs all-reduced), else with sequence parallelism allowed.

Tensor-parallel communication is overlapped with the GEMMs where the notes say the run did
("TP comm overlap on": NeMo's tp_comm_overlap, solver/tp_overlap.py), else priced exposed.
NeMo's interleaved pipelines overlap their sends in the steady state (overlap_p2p_comm, which
NeMo sets whenever virtual pipelining is on: solver/p2p_overlap.py).

torchtitan's fused attention is priced at the documented rates of the kernel torch's SDPA ran on
Hopper (attention_kernel_of: FlashAttention-2; cost_model/attention.py); other rows' attention, and
any on other GPUs, as a matmul of torch's FLOP count.

GPT-family attention is priced as the framework ran it: fused (SDPA, no s x s scores kept)
for NeMo / Megatron-Core runs (Transformer Engine's attention), unfused for Megatron-LM 2022.

Context parallelism is priced as the run's framework ran it (cp_kv_exchange_of): torchtitan's torch
`context_parallel`, Megatron-Core's Transformer Engine ring.

Recomputation is priced as the run's framework did it: torchtitan's "selective" activation
checkpointing in these runs is its op-level policy (autopar's "op" mode: keep matmul outputs
except every second one, attention and reduce-scatters), Megatron-LM's selective
recomputation with sequence parallelism is autopar's "selective" (which keeps gathered inputs
sharded and gathers them again in backward, as Megatron does).

The optimizer step is priced as the run's framework stepped it: Megatron-LM's fused Adam, and
torchtitan's AdamW as its default was at the run's date (foreach before 2025-02, fused since),
the date being the earliest the source gives (an arXiv id, a month and year). torchtitan's FSDP2
units are priced as its apply_fsdp wrapped them at that date: before 2025-08 the embedding, final
norm and head were the root unit, gathered once before the forward and reduce-scattered after the
whole backward, and the last block stayed gathered (cost_model/fsdp.py's root ends).

A power cap the notes state ("power-capped at 500 W") is set as the cluster's
`device.power_limit_w`, like the figures in cluster_overrides: the device's tensor peak then
follows its documented clock/power relation (cost_model/hardware.py). `--classes` prints the
compute of data-parallel rows by op class (matmul, attention, norm, elementwise, loss), with the
rate the matmul-class kernels are priced at (attention's FLOPs as torch counts them: the whole
s x s, also under a causal mask).

`--compile-gain` prices a compiled row whose notes give an eager measurement ("eager FSDP
measured 6258") also as that eager run (float32-composite norms) and prints the modelled gain
beside the measured one, with what the compiled pricing removes per op class.

Pipeline stages are cut as the run's framework cut them (`pipeline_split`, solver/pipeline.py),
not by autopar's balanced cut, derived from the source (framework_split):
- Megatron-LM and Megatron-Core (NeMo, Megatron-Bridge; every row that is not torchtitan's or
  Megatron-DeepSpeed's, as `policy_of` reads them): num_layers / (pp x vp) transformer layers per
  model chunk, the embedding on the first, the output layer and loss on the last ("uniform";
  megatron/core/transformer/transformer_block.py get_num_layers_to_build; Megatron-LM 2021-22
  asserts that the layers divide). The recipes of these rows set neither
  --account-for-embedding/loss-in-pipeline-split nor first/last-stage layer counts (NeMo 24.12's
  llama3_70b recipe, Megatron-Bridge's gpt_oss recipe); notes that say "account for embedding" /
  "account for loss" count those as a layer ("uniform:embedding", "uniform:head").
- Megatron-DeepSpeed: GPTModelPipe builds DeepSpeed's PipelineModule with
  partition_method='type:transformer' (equal counts of transformer layers: "uniform"); a run whose
  notes give `--pp-partition-method 'type:transformer|embedding'` (as BigScience's fork allows)
  counts the input embedding and the tied output embedding as layers, e.g. 70 + 2 = 12 x 6, rank 0
  [embed | 5 blocks], rank 11 [5 blocks | embed] = "uniform:embedding,head".
- torchtitan before pytorch/torchtitan#1416 (2025-07): generate_split_points, num_layers //
  stages on the first stage, one more on middle stages while the remainder lasts, the rest on the
  last (126 layers on 8 stages: 15, 16 x 6, 15 = "first=15,last=15"); since then
  generate_llm_fqn_per_model_part weighs the embedding and the output as a layer each
  ("uniform:embedding,head").
- a row whose notes state its split (Llama 3 405B: section 3.3.2) takes that one.
- notes naming Megatron-Core's num_layers_in_first_pipeline_stage N and
  num_layers_in_last_pipeline_stage M (NeMo's DeepSeek-V3 recipe) give "first=N,last=M".
A split the model's layers do not divide is printed as a warning and the row priced with the
balanced cut (the run cannot have cut so: the framework was misread).

`--ran` adds configurations that were run as published but whose step time is not in the
reference file (Llama 3 405B on 16,384 H100s as Meta trained it): it ran, so it must be predicted
to fit (block reuse: seconds to capture it). Korthikanti et al.'s 530B and 1T, once here, are rows of
published_bf16.csv with their Table 5 times.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from autopar import api
from autopar.cluster import Cluster
from autopar.plans.planning import default_tp_overlap
from autopar.solver.pipeline import BALANCED, block_flags, split_blocker
from autopar.solver.search import Planner, SearchOptions
from autopar.solver.step_model import Estimate, ParallelConfig
from cost_model.memory import BF16_ADAM, FP32_ADAM, FSDP2_BF16_FP32_REDUCE, MEGATRON_BF16, PrecisionPolicy
from cost_model.optimizer import adamw_io_bytes_per_param

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "published_runs.csv"
MORE_BF16 = Path(__file__).resolve().parent / "published_bf16.csv"
"""Published bf16 runs beyond the shared sample, in its format (DGX Cloud Benchmarking v25.02)."""
_MEMORY_NOTE = re.compile(r"(\d+(?:\.\d+)?)\s*(GiB|GB)\s+(?:used|measured)")
_OP_LEVEL = re.compile(r"\bop(?:-level)? (?:SAC|AC)\b|\bselective op AC\b", re.IGNORECASE)
_EAGER = re.compile(r"\beager \(compile off", re.IGNORECASE)
_POWER_CAP = re.compile(r"power-capped at (\d+(?:\.\d+)?)\s*W\b", re.IGNORECASE)
_EAGER_MEASURED = re.compile(r"\beager\b[^;]*?\bmeasured (\d+(?:\.\d+)?)", re.IGNORECASE)
_FUSED_ATTENTION_FRAMEWORK = re.compile(r"\bNeMo\b|\bMegatron-Core\b", re.IGNORECASE)
_DROPOUT = re.compile(r"\bdropout (\d(?:\.\d+)?)\b")
_TP_COMM_OVERLAP = re.compile(r"\bTP comm(?:unication)? overlap(?:ped)? on\b", re.IGNORECASE)
_ASYNC_TP = re.compile(r"\bAsyncTP on\b")
_NEMO_FAMILY = re.compile(r"\bNeMo\b|\bMegatron-Bridge\b")
_PARAM_GATHER_OVERLAP = re.compile(r"\boverlap\w*\b[^;]*\bparam(?:eter)?[ _-]gather\b|\bNeMo\b|\bMegatron-Bridge\b"
                                   r"|\bMegatron-MoE-ModelZoo\b", re.IGNORECASE)
_NO_SEQUENCE_PARALLEL = re.compile(r"\bTP without (?:SP|sequence parallelism)\b", re.IGNORECASE)
_DISTRIBUTED_FUSED_ADAM = re.compile(r"\bdistributed[ _]fused[ _]Adam\b", re.IGNORECASE)
_FP8_PARAMS = re.compile(r"\bfp8[ _]params\b", re.IGNORECASE)
_MEGATRON_BRIDGE = re.compile(r"\bMegatron-Bridge\b")
_BF16_GRADIENTS = re.compile(r"\bgrad_reduce_in_fp32 False\b")


def select_rows(runs: list, rows: str | None) -> list:
    """The runs whose id is in `rows` (comma-separated; all when None), in file order."""
    return [run for run in runs if run.id in rows.split(",")] if rows else runs


@dataclass(frozen=True, kw_only=True)
class Run:
    """One row of the reference file."""

    id: str
    source: str
    family: str
    shape: dict[str, int]
    gpus: int
    cluster: str
    cluster_overrides: dict[str, dict[str, float]]
    global_batch: int
    microbatch: int
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    cp: int
    """Context parallelism: ranks each sequence is split over (1 where the source has none)."""
    zero: int
    recompute: str
    precision: str
    metric: str
    published: float
    flop_formula: str
    measured_memory_bytes: float | None
    notes: str
    pipeline_split: str | None = None
    """The split its source states (None: its framework's, framework_split)."""

    @property
    def model(self) -> str:
        spec = f"{self.family}:" + ",".join(f"{key}={value}" for key, value in self.shape.items())
        if self.family == "gpt" and self.fused_attention:
            spec += ",attention=sdpa"
        if self.family == "gpt" and self.dropout is not None:
            spec += f",dropout={self.dropout}"
        return spec + ",norm=float32" if self.family == "llama" and self.float32_norm else spec

    @property
    def dropout(self) -> float | None:
        """The GPT's dropout where the notes state it ("dropout 0.0": NeMo 2.0's GPTConfig175B sets
        hidden and attention dropout 0.0); None: the built-in GPT's 0.1, Megatron-Core's default."""
        stated = _DROPOUT.search(self.notes)
        return float(stated.group(1)) if stated else None

    @property
    def fused_attention(self) -> bool:
        """Attention as the run's framework computed it. Megatron-Core, which NeMo runs, builds
        its layers from Transformer Engine's spec, whose DotProductAttention is a fused (flash or
        cuDNN) kernel that keeps no s x s scores: the GPT family's attention="sdpa". Megatron-LM
        and Megatron-DeepSpeed of 2022 (Korthikanti et al., BLOOM) ran the unfused softmax over
        materialised scores (the GPT family's default, "eager"). The built-in Llama is SDPA
        always."""
        return bool(_FUSED_ATTENTION_FRAMEWORK.search(self.source))

    @property
    def float32_norm(self) -> bool:
        """torchtitan run eager in 2024 normalized in float32 ops: its Llama 3 8B preset for 64
        A100s (pytorch/torchtitan train_configs/llama3_8b.toml of that era: norm_type = "rmsnorm",
        compile = false) upcasts like the built-in Llama's norm="float32"; compiled runs fuse it."""
        return "torchtitan" in self.source.lower() and bool(_EAGER.search(self.notes))

    @property
    def num_nodes(self) -> int:
        return max(1, self.gpus // 8)

    def cluster_spec(self, directory: Path) -> str:
        """A spec string, or a TOML file in `directory` when the source states figures."""
        if not self.cluster_overrides:
            return f"{self.cluster}:nodes={self.num_nodes}"
        lines = [f'preset = "{self.cluster}"', f"nodes = {self.num_nodes}"]
        for table, values in self.cluster_overrides.items():
            lines.append(f"[{table}]")
            lines += [f"{key} = {value}" for key, value in values.items()]
        path = directory / f"{self.id}.toml"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    @property
    def sequence_parallel(self) -> bool:
        """False where the notes say the run's tensor parallelism had no sequence parallelism
        (Korthikanti et al.'s baselines): it is then priced with `sequence_parallel=False`."""
        return not _NO_SEQUENCE_PARALLEL.search(self.notes)

    @property
    def tp_comm_overlap(self) -> bool:
        """Whether the notes say the run overlapped its tensor-parallel communication with the
        GEMMs ("TP comm overlap on": NeMo's tp_comm_overlap); priced so (solver/tp_overlap.py)."""
        return bool(_TP_COMM_OVERLAP.search(self.notes))

    @property
    def async_tp(self) -> bool:
        """Whether the notes say the run ran torch's async TP ("AsyncTP on": torchtitan's
        enable_async_tensor_parallel). Priced exposed unless asked (PrecisionPolicy.with_torch_async_tp)."""
        return bool(_ASYNC_TP.search(self.notes))

    @property
    def p2p_overlap(self) -> bool:
        """Whether the run's framework overlapped its interleaved pipeline's sends with compute:
        NeMo's MegatronCommOverlapCallback, and Megatron-Bridge's CommOverlapConfig after it, set
        Megatron-Core's overlap_p2p_comm whenever virtual pipelining is on (solver/p2p_overlap.py);
        Megatron-LM of 2021-2022 waited on its sends."""
        return bool(_NEMO_FAMILY.search(self.source))

    @property
    def distributed_fused_adam(self) -> bool:
        """Whether the run stepped NeMo 1.0's distributed fused Adam (optim.name
        distributed_fused_adam: nemo/core/optim/distributed_adam.py over Apex's
        DistributedFusedAdam), which holds the gradients and optimizer state itself, not
        Megatron-Core's distributed optimizer: DISTRIBUTED_FUSED_ADAM_GRAD_BYTES and _OPTIMIZER_BYTES."""
        return uses_distributed_fused_adam(self.notes)

    @property
    def param_gather_overlap(self) -> bool:
        """Whether the run's distributed optimizer gathered its parameters inside the next
        forward (PrecisionPolicy.param_gather_overlap): see param_gather_overlapped."""
        return param_gather_overlapped(f"{self.source} {self.notes}")

    @property
    def recompute_mode(self) -> str:
        """autopar's mode for the run's recomputation (the notes say when it was op-level; Megatron's
        sequence parallelism keeps shards: as_megatron_saves)."""
        if self.recompute == "selective" and _OP_LEVEL.search(self.notes):
            return "op"
        if "torchtitan" not in self.source.lower():
            return as_megatron_saves(self.recompute, self.tp, self.sequence_parallel)
        return self.recompute

    @property
    def zero_as_run(self) -> int:
        """The ZeRO stage autopar prices the run's data parallelism as. torchtitan under pipelining
        shards with FSDP2 but never reshards after forward (apply_fsdp: reshard_after_forward=False
        when pp is enabled, pytorch/torchtitan 9dec370), and torch's PipelineStage keeps every
        unit gathered after each microbatch's backward (set_reshard_after_backward(False)): the
        parameters are gathered once and held for the step, gradients reduce-scattered once: what
        autopar's ZeRO-2 under pipelining does. Otherwise the row's stage."""
        if "torchtitan" in self.source.lower() and self.pp > 1 and self.zero == 3:
            return 2
        return self.zero

    def config(self, planner) -> ParallelConfig:
        interleaved = self.virtual_stages > 1
        return api.fixed_config(planner, tp=self.tp, pp=self.pp, dp=self.dp, microbatch_size=self.microbatch,
                                schedule="interleaved" if interleaved else "1f1b",
                                virtual_stages=self.virtual_stages if interleaved else None,
                                layers_per_virtual_stage=None, recompute=self.recompute_mode,
                                zero_stage=self.zero_as_run, cp=self.cp, sequence_parallel=self.sequence_parallel,
                                pipeline_split=split_as_run(self, planner.graph))

    def predicted(self, step_time_s: float) -> float:
        """The prediction in the source's unit."""
        if self.metric == "step_time_s":
            return step_time_s
        if self.metric == "tokens_per_s_per_gpu":
            return self.global_batch * self.shape["seq"] / step_time_s / self.gpus
        if self.metric == "tflops_per_gpu":
            return self.flops_per_step() / step_time_s / self.gpus / 1e12
        raise ValueError(f"{self.id}: unknown metric '{self.metric}'")

    def flops_per_step(self) -> float:
        """Megatron's model-FLOP formulas (formulas.md): 72 (no recompute) or 96 (full)."""
        b, s = self.global_batch, self.shape["seq"]
        layers, h, v = self.shape["layers"], self.shape["hidden"], self.shape["vocab"]
        factor = {"megatron-72": 72, "megatron-96": 96}.get(self.flop_formula)
        if factor is None:
            raise ValueError(f"{self.id}: metric tflops_per_gpu needs flop_formula megatron-72 or megatron-96")
        return factor * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq")


def read_runs(path: Path = REFERENCE) -> list[Run]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [_run(item) for item in csv.DictReader(lines)]


def _run(item: dict[str, str]) -> Run:
    shape = {key: int(item[key]) for key in _SHAPE_KEYS if item.get(key)}
    memory = _MEMORY_NOTE.search(item.get("notes", ""))
    memory_bytes = None
    if memory:
        memory_bytes = float(memory.group(1)) * (2**30 if memory.group(2) == "GiB" else 1e9)
    overrides = _overrides(item.get("cluster_overrides", ""))
    power_cap = _POWER_CAP.search(item.get("notes", ""))
    if power_cap:  # a figure the source states, like the overrides: the cap the GPUs ran under
        overrides.setdefault("device", {}).setdefault("power_limit_w", float(power_cap.group(1)))
    return Run(id=item["id"], source=item["source"], family=item["family"], shape=shape, gpus=int(item["gpus"]), cluster=item["cluster"],
               cluster_overrides=overrides,
               global_batch=int(item["global_batch"]), microbatch=int(item["microbatch"]), tp=int(item["tp"]),
               pp=int(item["pp"]), dp=int(item["dp"]), virtual_stages=int(item["virtual_stages"] or 1),
               cp=int(item.get("cp") or 1), zero=int(item["zero"] or 0), recompute=item["recompute"], precision=item["precision"],
               metric=item["metric"], published=float(item["published"]), flop_formula=item["flop_formula"],
               measured_memory_bytes=memory_bytes, notes=item.get("notes", ""))


def _overrides(text: str) -> dict[str, dict[str, float]]:
    """"device.memory_gib=95;device.memory_bandwidth_gbs=2400" -> {"device": {...}}."""
    tables: dict[str, dict[str, float]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, _, value = item.partition("=")
        table, _, name = key.partition(".")
        tables.setdefault(table, {})[name] = float(value)
    return tables


def as_megatron_saves(mode: str, tp: int, sequence_parallel: bool = True) -> str:
    """Megatron-LM's and Transformer Engine's sequence-parallel linears save their input as its
    sequence shard and all-gather it again in backward (Megatron's LinearWithGradAccumulationAnd-
    AsyncCommunication, TE's "overlap input AG with dgrad"): without recomputation that is autopar's
    "gathers" mode (Korthikanti et al.'s 34 s b h / t a layer), not "none", which keeps the gathered
    input as DTensor does. The re-gathers run beside the input-gradient GEMMs
    (MEGATRON_BF16.regather_overlap)."""
    return "gathers" if mode == "none" and tp > 1 and sequence_parallel else mode


def precision_of(run: Run) -> str:
    """fp16 mixed precision is priced as bf16 (same bytes, same tensor-core rate)."""
    return "fp32" if run.precision == "fp32" else "bf16"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    run: Run
    estimate: Estimate
    predicted: float
    error: float
    """Relative error of the prediction in the source's unit: predicted / published - 1."""
    seconds: float


_PLANNERS: dict[tuple, object] = {}
_GRAPHS: dict[tuple, object] = {}


TORCH_PREFERS_CUDNN_ATTENTION_SINCE = (2026, 1)
"""torch's SDPA runs its flash backend (FlashAttention-2) on Hopper until it puts cuDNN first
(check_prefer_cudnn_attention, from the cuDNN above 9.15 that torch 2.11 bundles; pytorch#138522 had
made cuDNN opt-in after 2.5): no torchtitan row here is that recent."""


def attention_kernel_of(run: Run) -> str:
    """The fused attention kernel the run's framework ran, where it is named (cost_model/attention.py):
    torchtitan, torch's SDPA flash backend (FlashAttention-2) before TORCH_PREFERS_CUDNN_ATTENTION_SINCE,
    cuDNN after; "" (priced as a matmul of torch's count) for the rest. Transformer Engine (NeMo,
    Megatron-Core) prefers its cuDNN FusedAttention on Hopper, but is not named here: priced at the
    microbenchmark's cuDNN rates, NeMo's Llama 3 8B FP8 row comes out 14% fast and the DGX Cloud
    Llama 3.1 70B row's stage partition no longer fits (docs/accuracy.md); Megatron-LM 2021-2022
    ran unfused attention."""
    if "torchtitan" in run.source.lower():
        when = run_month(run.source)
        return "flash2" if when is None or when < TORCH_PREFERS_CUDNN_ATTENTION_SINCE else "cudnn"
    return ""


_COMPILE_ON = re.compile(r"\btorch\.compile on\b|\bcompile\b(?! off)", re.IGNORECASE)


def cp_kv_exchange_of(run: Run) -> str:
    """How the run's context parallelism moved keys and values (cost_model/context_parallel.py):
    torchtitan ran torch's `context_parallel` ("torch_compiled" where its blocks were compiled,
    its collectives then waited where issued; "torch" eager); Megatron-Core (NeMo, Megatron-Bridge)
    runs Transformer Engine's ring, "ring": TEDotProductAttention passes cp_comm_type "p2p" when the
    config names none (megatron/core/extensions/transformer_engine.py; before TE 1.10 the ring was
    the only kind), each step's K, V sent on while the current block is attended, the backward
    passing K, V and dK, dV around again, and only the rank's own K, V saved."""
    if "torchtitan" not in run.source.lower():
        return "ring"
    return "torch" if _EAGER.search(run.notes) or not _COMPILE_ON.search(run.notes) else "torch_compiled"


def with_attention_kernel(cluster: Cluster, kernel: str) -> Cluster:
    """`cluster` with its device running `kernel`, where the device documents its rates (Hopper);
    unchanged elsewhere (attention then priced as a matmul)."""
    if not kernel or all(known.name != kernel for known in cluster.device.attention_kernels):
        return cluster
    return replace(cluster, device=replace(cluster.device, attention_kernel=kernel))


def planner_for(run: Run, directory: Path):
    """One capture per (model, cluster, batch, precision): rows that differ only in their
    configuration (Korthikanti's baseline and SP + selective rows) share it."""
    key = (run.model, run.cluster, tuple(sorted((t, tuple(sorted(v.items()))) for t, v in run.cluster_overrides.items())),
           run.num_nodes, run.global_batch, precision_of(run), policy_of(run), attention_kernel_of(run),
           cp_kv_exchange_of(run))
    if key not in _PLANNERS:
        graph_key = (run.model, precision_of(run))
        if graph_key not in _GRAPHS:  # rows of one model on other clusters share the capture too
            _GRAPHS[graph_key] = api.capture_for_planning(run.model, precision=precision_of(run))
        graph = _GRAPHS[graph_key]
        cluster = with_attention_kernel(Cluster.from_spec(run.cluster_spec(directory)), attention_kernel_of(run))
        _PLANNERS[key] = Planner(graph, cluster, global_batch=run.global_batch, policy=policy_of(run),
                                 precision=precision_of(run), options=SearchOptions(cp_kv_exchange=cp_kv_exchange_of(run)))
    return _PLANNERS[key]


TORCHTITAN_FUSED_ADAMW_SINCE = (2025, 2)
"""torchtitan built AdamW with `foreach=True` (its `--optimizer.fused` off by default) until
pytorch/torchtitan#881 ("use Fused AdamW as default", 2025-02-24)."""


TORCHTITAN_SEPARATE_ENDS_SINCE = (2025, 8)
"""torchtitan's apply_fsdp wrapped each transformer block and then the whole model, so the
embedding, final norm and output head were the root unit, and kept the last block gathered
after forward (cost_model/fsdp.py's root ends), until pytorch/torchtitan#1094 ("Improve
reshard_after_forward logic", 2025-07-28) gave the embedding and [norm, output] units of their own."""


TORCH_GATHER_VIEWS_SINCE = (2025, 12)
"""torch's functional all-gather copied its chunks into place on every dim but 0 until
pytorch/pytorch#169404 (2025-12), which makes it a view where the dims before the gathered one
hold one element (PrecisionPolicy.sp_layout_copies "all" before, "batched_gathers" since)."""


MEGATRON_BF16_MAIN_GRAD_BYTES = 4.0
"""Megatron's gradients under bf16 are fp32 "main grads", accumulated and reduced in fp32: Megatron-LM
forces --accumulate-allreduce-grads-in-fp32 when --bf16 is set (megatron/training/arguments.py),
and NeMo's bf16_mixed() sets Megatron-Core's grad_reduce_in_fp32=True (its grad buffer holds
fp32). fp16 runs keep fp16 gradients unless asked (the flag's default)."""


MEGATRON_BRIDGE_PERF_GRAD_BYTES = 2.0
"""Megatron-Bridge's performance configurations (scripts/performance/configs/llama/*_pretrain.py,
gpt_oss, deepseek; perf_recipes/_common.py since) set grad_reduce_in_fp32 False on both the mixed
precision and the DDP config: bf16 gradient buffers, reduce-scattered in bf16. NeMo 2.0's performance
scripts (scripts/performance/llm/*.py, 2025) set the same; rows whose notes say so get it too."""

DISTRIBUTED_FUSED_ADAM_GRAD_BYTES = 2.0
"""NeMo 1.0's distributed fused Adam accumulates every gradient into its contiguous buffer, full
size, in `grad_sync_dtype` and reduce-scatters that buffer (Apex DistributedFusedAdam
_init_grad_buffer: dtype=self.grad_sync_dtype): bf16 where the run's config sets
optim.grad_sync_dtype bf16, as NeMo's launcher configs do (every pretraining yaml of DGX Cloud's
v25.02 recipes: Llama 3.1 8B/70B/405B, GPT-3 175B), not Megatron-Core's fp32 main gradients."""

DISTRIBUTED_FUSED_ADAM_OPTIMIZER_BYTES = 10.0
"""Its optimizer state per parameter, sharded over data parallel (x cp): Adam's two fp32 moments
and, for a bf16 model with an fp32 optimizer, only the low 16 bits of each fp32 master weight, the
bf16 parameter holding the high ones (store_param_remainders, which NeMo's
megatron_base_model.setup_optimization sets unless fp8_params, where it stores fp32 masters: 12)."""


def param_gather_overlapped(text: str) -> bool:
    """Whether a Megatron-Core run described by `text` (source and notes) overlapped its
    distributed optimizer's parameter all-gather with the next forward (overlap_param_gather):
    where the text says so, and where its framework's recipes set it: NeMo 2.0's (24.12:
    nemo/collections/llm/recipes/*.py, DistributedDataParallelConfig(overlap_param_gather=True)),
    Megatron-Bridge's (v0.4.0 recipes, e.g. gpt_oss.py: cfg.ddp.overlap_param_gather = True) and
    the Megatron-MoE-ModelZoo benchmarking configs (--overlap-param-gather true). Else
    Megatron-LM's default (--overlap-param-gather off: all gathered after the optimizer step)."""
    return bool(_PARAM_GATHER_OVERLAP.search(text))


def uses_distributed_fused_adam(notes: str) -> bool:
    """Whether a run's notes name NeMo 1.0's distributed fused Adam (Run.distributed_fused_adam)."""
    return bool(_DISTRIBUTED_FUSED_ADAM.search(notes))


def megatron_states(source: str, notes: str, precision: str) -> PrecisionPolicy:
    """MEGATRON_BF16 with the gradient and optimizer bytes of the Megatron-family framework a
    run's source and notes name: fp32 main gradients under bf16 (MEGATRON_BF16_MAIN_GRAD_BYTES);
    bf16 ones where Megatron-Bridge's performance configurations ran it, or the notes say
    "grad_reduce_in_fp32 False" (NeMo 2.0's performance scripts: MEGATRON_BRIDGE_PERF_GRAD_BYTES);
    NeMo 1.0's distributed fused Adam's bf16 buffer and 16-bit master remainders
    (DISTRIBUTED_FUSED_ADAM_*)."""
    policy = replace(MEGATRON_BF16,
                     grad_bytes=MEGATRON_BF16_MAIN_GRAD_BYTES if precision == "bf16" else MEGATRON_BF16.grad_bytes)
    if _MEGATRON_BRIDGE.search(source) or _BF16_GRADIENTS.search(notes):
        policy = replace(policy, grad_bytes=MEGATRON_BRIDGE_PERF_GRAD_BYTES, reduce_bytes=MEGATRON_BRIDGE_PERF_GRAD_BYTES)
    if uses_distributed_fused_adam(notes):
        optimizer_bytes = MEGATRON_BF16.optimizer_bytes if _FP8_PARAMS.search(notes) \
            else DISTRIBUTED_FUSED_ADAM_OPTIMIZER_BYTES
        policy = replace(policy, grad_bytes=DISTRIBUTED_FUSED_ADAM_GRAD_BYTES,
                         reduce_bytes=DISTRIBUTED_FUSED_ADAM_GRAD_BYTES, optimizer_bytes=optimizer_bytes)
    return policy


def policy_of(run: Run) -> PrecisionPolicy:
    """How the run's framework holds and reduces its states: torchtitan's FSDP2 gathers bf16 and
    reduce-scatters fp32 (MixedPrecisionPolicy), wraps the model as it did at the run's time (the
    embedding and head in the root unit before 2025-08), and steps AdamW as its default of the
    run's time was (foreach before 2025-02, fused since); Megatron-LM uses its bf16/fp16
    parameters as they are in every microbatch (no cast per use, unlike autopar's runtime), fp32
    main gradients under bf16 (MEGATRON_BF16_MAIN_GRAD_BYTES), and a fused Adam; NeMo runs with TP
    comm overlap where the notes say so, and with its interleaved pipeline's sends overlapped
    (Run.p2p_overlap); NeMo 1.0's distributed fused Adam holds bf16 gradients and a smaller
    optimizer state (Run.distributed_fused_adam); torchtitan's sequence-parallel collectives copy
    their chunks as the torch of the run's time did (TORCH_GATHER_VIEWS_SINCE)."""
    if run.precision == "fp32":
        return FP32_ADAM
    if "torchtitan" not in run.source.lower():
        return replace(megatron_states(run.source, run.notes, run.precision), tp_comm_overlap=run.tp_comm_overlap,
                       p2p_overlap=run.p2p_overlap, param_gather_overlap=run.param_gather_overlap)
    when = run_month(run.source)
    policy = FSDP2_BF16_FP32_REDUCE
    if when is not None and when < TORCHTITAN_SEPARATE_ENDS_SINCE:
        policy = replace(policy, fsdp_root_ends=True)
    if when is not None and when < TORCHTITAN_FUSED_ADAMW_SINCE:
        policy = replace(policy, optimizer_io_bytes_per_param=adamw_io_bytes_per_param("foreach"))
    if when is not None and when < TORCH_GATHER_VIEWS_SINCE:
        policy = replace(policy, sp_layout_copies="all")
    return policy


_ARXIV_ID = re.compile(r"\barXiv[: ]+(\d{2})(\d{2})\.\d{4,5}", re.IGNORECASE)
_ISO_MONTH = re.compile(r"\b(20\d\d)-(0[1-9]|1[0-2])\b")
_NAMED_MONTH = re.compile(r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b[^;()]*?\b(20\d\d)\b")
_YEAR = re.compile(r"\b(20\d\d)\b")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


def run_month(source: str) -> tuple[int, int] | None:
    """The earliest (year, month) a source text dates its run by: an arXiv id (2410.06511 is
    2024-10), "2025-06", a named month before its year ("Apr-Aug 2024" is 2024-04), or a bare
    year, taken as its December (a year alone says the run was not later); None: no date."""
    found = [(2000 + int(year), int(month)) for year, month in _ARXIV_ID.findall(source)]
    found += [(int(year), int(month)) for year, month in _ISO_MONTH.findall(source)]
    found += [(int(year), _MONTHS.index(month.lower()) + 1) for month, year in _NAMED_MONTH.findall(source)]
    found += [(int(year), 12) for year in _YEAR.findall(source)]
    return min(found, default=None)


_MEGATRON_DEEPSPEED = re.compile(r"\bMegatron-DeepSpeed\b", re.IGNORECASE)
_EMBEDDINGS_AS_LAYERS = re.compile(r"type:transformer\|embedding", re.IGNORECASE)
_ACCOUNTS_FOR = {"embedding": re.compile(r"\baccount(?:s|ed)?[-_ ]for[-_ ]embedding\b", re.IGNORECASE),
                 "head": re.compile(r"\baccount(?:s|ed)?[-_ ]for[-_ ]loss\b", re.IGNORECASE)}
TORCHTITAN_WEIGHTED_SPLIT_SINCE = (2025, 7)
"""pytorch/torchtitan#1416 ("Refactor PP splitting", merged 2025-07): the embedding and the output
weigh a layer each in generate_llm_fqn_per_model_part; before, generate_split_points split layers."""


_FIRST_STAGE_LAYERS = re.compile(r"\bnum_layers_in_first_pipeline_stage[ =]+(\d+)")
_LAST_STAGE_LAYERS = re.compile(r"\bnum_layers_in_last_pipeline_stage[ =]+(\d+)")


def framework_split(run, num_layers: int, num_chunks: int) -> str:
    """The pipeline split of the run's framework (the module docstring says each, with its source);
    `run` has a source and notes (a Run, or published_moe's MoeRun)."""
    if getattr(run, "pipeline_split", None):
        return run.pipeline_split
    text = f"{run.source}; {run.notes}"
    if "torchtitan" in run.source.lower():
        when = run_month(run.source)
        if when is not None and when >= TORCHTITAN_WEIGHTED_SPLIT_SINCE:
            return "uniform:embedding,head"
        return _torchtitan_2024_split(num_layers, num_chunks)
    if _MEGATRON_DEEPSPEED.search(text) and _EMBEDDINGS_AS_LAYERS.search(run.notes):
        return "uniform:embedding,head"
    first, last = _FIRST_STAGE_LAYERS.search(run.notes), _LAST_STAGE_LAYERS.search(run.notes)
    if first and last:  # Megatron-Core's num_layers_in_first/last_pipeline_stage, the rest even
        return f"first={first.group(1)},last={last.group(1)}"
    counted = [name for name, pattern in _ACCOUNTS_FOR.items() if pattern.search(run.notes)]
    return "uniform" + (":" + ",".join(counted) if counted else "")


def _torchtitan_2024_split(num_layers: int, num_chunks: int) -> str:
    """torchtitan's generate_split_points (2024): num_layers // stages layers on the first stage,
    one more on each middle stage while the remainder lasts, the rest on the last."""
    base, extra = divmod(num_layers, num_chunks)
    middle = [base + 1 if stage < extra else base for stage in range(num_chunks - 2)]
    last = num_layers - base - sum(middle)
    if num_chunks > 2 and len(set(middle)) > 1:
        return f"torchtitan-2024:{middle}"  # uneven middle stages: no split by count names them (refused)
    return f"first={base},last={last}"


def split_as_run(run, graph) -> str:
    """The run's split (framework_split) where the model's blocks divide by it, else the balanced
    cut with a warning on stderr."""
    num_chunks = run.pp * max(run.virtual_stages, 1)
    if run.pp == 1:
        return BALANCED
    is_block = block_flags(graph.segments)
    split = framework_split(run, sum(is_block), num_chunks)
    blocker = split_blocker(is_block, num_chunks, split)
    if blocker:
        print(f"warning: {run.id}: its framework's split does not cut this model ({blocker}); priced with the "
              "balanced cut", file=sys.stderr)
        return BALANCED
    return split


def evaluate_run(run: Run, directory: Path) -> Outcome:
    started = time.perf_counter()
    planner = planner_for(run, directory)
    estimate, _ = planner.evaluate(run.config(planner))
    predicted = run.predicted(estimate.step_time_s)
    return Outcome(run=run, estimate=estimate, predicted=predicted, error=predicted / run.published - 1,
                   seconds=time.perf_counter() - started)


AUTOPAR_RUNTIME_FUSED_ADAMW = replace(BF16_ADAM, optimizer_io_bytes_per_param=adamw_io_bytes_per_param("fused"))
"""autopar's runtime (fp32 weights behind bf16 copies made once per step, gradients accumulated
into fp32) with a fused AdamW, as the framework rows ran theirs: the same plan in autopar's hands."""


def runtime_step_s(run: Run, directory: Path) -> float | None:
    """The run's configuration priced for autopar's runtime (bf16 rows only; None otherwise), with
    the tp_overlap the planner gives autopar's runtime on the run's cluster (async TP on CUDA:
    planning.default_tp_overlap; it hides only sequence parallelism's collectives)."""
    if precision_of(run) != "bf16":
        return None
    framework = planner_for(run, directory)
    overlap = default_tp_overlap(framework.cluster, "bf16") == "async"
    planner = Planner(framework.graph, framework.cluster, global_batch=run.global_batch,
                      policy=AUTOPAR_RUNTIME_FUSED_ADAMW.with_torch_async_tp(overlap),
                      precision="bf16")
    estimate, _ = planner.evaluate(run.config(planner))
    return estimate.step_time_s


def evaluate_all(runs: list[Run]) -> list[Outcome]:
    with tempfile.TemporaryDirectory() as directory:
        return [evaluate_run(run, Path(directory)) for run in runs]


def _row(outcome: Outcome) -> str:
    run, estimate = outcome.run, outcome.estimate
    gib = 2**30
    measured = f"{run.measured_memory_bytes / gib:.1f}" if run.measured_memory_bytes else "-"
    memory_error = (f"{100 * (estimate.peak_memory_bytes / run.measured_memory_bytes - 1):+.0f}%"
                    if run.measured_memory_bytes else "-")
    published = "-" if run.published != run.published else f"{run.published:g}"
    error = "-" if outcome.error != outcome.error else f"{100 * outcome.error:+.1f}%"
    return (f"| {run.id} | {run.metric} | {published} | {outcome.predicted:.4g} | {error} | "
            f"{estimate.peak_memory_bytes / gib:.1f} | {measured} | {memory_error} | "
            f"{'yes' if estimate.fits else 'NO'} | {outcome.seconds:.1f} |")


def _ran(id: str, source: str, shape: dict[str, int], *, gpus: int, cluster: str, global_batch: int, tp: int, pp: int,
         dp: int, virtual_stages: int = 1, zero: int = 0, recompute: str, notes: str,
         pipeline_split: str | None = None) -> Run:
    return Run(id=id, source=source, family="gpt" if "kv_heads" not in shape else "llama", shape=shape, gpus=gpus,
               cluster=cluster, cluster_overrides={}, global_batch=global_batch, microbatch=1, tp=tp, pp=pp, dp=dp,
               virtual_stages=virtual_stages, cp=1, zero=zero, recompute=recompute, precision="bf16", metric="step_time_s",
               published=float("nan"), flop_formula="-", measured_memory_bytes=None, notes=notes,
               pipeline_split=pipeline_split)


RAN = (
    _ran("llama3-405b", "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4 and section 3.3.2",
         dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256, seq=8192), gpus=16384,
         cluster="dgx-h100", global_batch=2048, tp=8, pp=16, dp=128, virtual_stages=8, zero=2, recompute="gathers",
         notes="no activation checkpointing (Megatron-style SP keeps norm outputs sharded: autopar's 'gathers'); "
               "interleaved with one layer per virtual stage (section 3.3.2: the first model chunk of the first "
               "stage holds only the embedding, the last one of the last stage only the output and the loss: "
               "126 + 2 = 16 x 8); FSDP shards optimizer states and gradients, parameters not resharded after "
               "forward (ZeRO-2), fp32 gradient accumulation and reduce-scatter; 80 GB H100s",
         pipeline_split="uniform:embedding,head"),
)
"""Configurations that ran as published, without a step time in the reference file: fit checks."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--breakdown", action="store_true", help="also print each row's time and memory breakdown")
    parser.add_argument("--ran", action="store_true", help="add the configurations that ran (fit checks; slow)")
    parser.add_argument("--classes", action="store_true",
                        help="also print each data-parallel row's compute by op class (matmul, attention, ...)")
    parser.add_argument("--compile-gain", action="store_true",
                        help="for compiled rows whose notes give an eager measurement: modelled vs measured gain, "
                             "and what the model's compiled pricing removes, by op class")
    parser.add_argument("--runtime", action="store_true",
                        help="also price each bf16 row for autopar's runtime (its precision handling, fused AdamW) "
                             "against the framework's handling")
    args = parser.parse_args()
    runs = (read_runs() if REFERENCE.exists() else []) + read_runs(MORE_BF16) + (list(RAN) if args.ran else [])
    runs = select_rows(runs, args.rows)
    print("| run | unit | published | predicted | error | predicted peak GiB | measured GiB | memory error | fits | "
          "time (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    outcomes = []
    with tempfile.TemporaryDirectory() as directory:
        for run in runs:
            outcome = evaluate_run(run, Path(directory))
            outcomes.append(outcome)
            print(_row(outcome), flush=True)
            if args.breakdown:
                _print_breakdown(outcome.estimate)
            if args.classes:
                _print_classes(run, Path(directory))
            if args.compile_gain:
                _print_compile_gain(outcome, Path(directory))
            if args.runtime:
                _print_runtime(outcome, Path(directory))
    errors = [abs(outcome.error) for outcome in outcomes if outcome.error == outcome.error]
    if errors:
        print(f"\nmedian absolute error {100 * statistics.median(errors):.1f}%, "
              f"largest {100 * max(errors):.1f}%, {sum(e <= 0.10 for e in errors)}/{len(errors)} within 10%")
    return 0


def _print_runtime(outcome: Outcome, directory: Path) -> None:
    runtime_s = runtime_step_s(outcome.run, directory)
    if runtime_s is not None:
        framework_s = outcome.estimate.step_time_s
        print(f"|   | autopar's runtime: step {runtime_s:.4g} s against {framework_s:.4g} s with the framework's "
              f"handling ({100 * (runtime_s / framework_s - 1):+.1f}%) |")


def _print_breakdown(estimate: Estimate) -> None:
    parts = ", ".join(f"{name} {seconds:.3g}" for name, seconds in estimate.breakdown_s.items() if seconds)
    memory = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in estimate.memory_bytes.items() if size)
    print(f"|   | step {estimate.step_time_s:.4g} s: {parts} |")
    print(f"|   | memory GiB: {memory} |")


def op_class(target: str) -> str:
    """The op class of an aten overload, for the compute breakdown."""
    if "scaled_dot_product" in target:
        return "attention"
    if any(name in target for name in ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.linear.", "aten.matmul.")):
        return "matmul"
    if "rms_norm" in target or "layer_norm" in target:
        return "norm"
    if any(name in target for name in ("log_softmax", "nll_loss", "cross_entropy")):
        return "loss"
    if "embedding" in target:
        return "embedding"
    return "elementwise"


def class_times(run: Run, directory: Path) -> dict[str, tuple[float, float, float, float]]:
    """Per op class (forward s, backward s, forward matmul FLOPs, backward matmul FLOPs) of one
    microbatch on one device, priced kernel by kernel as the step model prices them. Only rows
    without tp or cp: their ops run unsharded on every rank (FSDP shards states, not compute)."""
    planner = planner_for(run, directory)
    graph = planner.graph.with_batch(run.microbatch)
    compute = planner.step_model.compute
    totals: dict[str, list[float]] = {}
    for node in graph.nodes:
        if node.kind != "call":
            continue
        row = totals.setdefault(op_class(node.target), [0.0, 0.0, 0.0, 0.0])
        row[0] += compute.kernels(node.fwd_kernels).total_s
        row[1] += compute.kernels(node.bwd_kernels).total_s
        row[2] += sum(kernel.flops for kernel in node.fwd_kernels if kernel.is_matmul)
        row[3] += sum(kernel.flops for kernel in node.bwd_kernels if kernel.is_matmul)
    return {name: tuple(values) for name, values in totals.items()}


def _print_classes(run: Run, directory: Path) -> None:
    if run.tp > 1 or run.pp > 1:
        print("|   | op classes: only for rows without tp or pp |")
        return
    steps = run.global_batch // run.microbatch // run.dp
    parts = []
    for name, (forward, backward, forward_flops, backward_flops) in sorted(
            class_times(run, directory).items(), key=lambda item: -(item[1][0] + item[1][1])):
        rate = (f" at {forward_flops / forward / 1e12:.0f}/{backward_flops / backward / 1e12:.0f} TF/s"
                if forward_flops and backward_flops else "")
        parts.append(f"{name} {steps * forward:.3g}+{steps * backward:.3g}{rate}")
    print(f"|   | compute by op class, forward+backward s per step ({steps} microbatches): {', '.join(parts)} |")


def eager_twin(run: Run) -> Run | None:
    """The row as its source's eager measurement ran (float32-composite norms, the notes' figure
    as published), for compiled rows whose notes state one; None otherwise."""
    measured = _EAGER_MEASURED.search(run.notes)
    if measured is None or run.float32_norm or run.family != "llama":
        return None
    return replace(run, id=run.id + ":eager", published=float(measured.group(1)),
                   notes=run.notes + "; eager (compile off: the notes' eager measurement)")


def _print_compile_gain(outcome: Outcome, directory: Path) -> None:
    """What the model's compiled pricing (fused norms) removes from its eager one (the float32
    composite), by op class, against the gain the source measured."""
    run = outcome.run
    eager = eager_twin(run)
    if eager is None:
        return
    eager_outcome = evaluate_run(eager, directory)
    steps = run.global_batch // run.microbatch // run.dp
    compiled_classes, eager_classes = class_times(run, directory), class_times(eager, directory)
    removed = []
    for name in sorted(set(compiled_classes) | set(eager_classes)):
        before = sum(eager_classes.get(name, (0.0, 0.0))[:2])
        after = sum(compiled_classes.get(name, (0.0, 0.0))[:2])
        if abs(before - after) > 1e-6:
            removed.append(f"{name} {steps * (before - after) * 1e3:+.0f} ms")
    recompute = (eager_outcome.estimate.breakdown_s.get("recompute", 0.0)
                 - outcome.estimate.breakdown_s.get("recompute", 0.0))
    modelled = eager_outcome.estimate.step_time_s / outcome.estimate.step_time_s
    measured = run.published / eager.published if run.metric != "step_time_s" else eager.published / run.published
    print(f"|   | compile gain: modelled {modelled:.3f}x (eager {eager_outcome.predicted:.4g}, "
          f"{100 * eager_outcome.error:+.1f}% of its measured {eager.published:g}), measured {measured:.3f}x; "
          f"the compiled pricing removes per step: {', '.join(removed)}, recompute {recompute * 1e3:+.0f} ms |")


if __name__ == "__main__":
    sys.exit(main())

"""Published, measured mixture-of-experts runs (shared/reference/published_moe.csv, and those of
benchmarks/published_moe_more.csv beyond that sample) against autopar's prediction of the same
configuration, and against the plan autopar would choose.

    .venv/bin/python benchmarks/published_moe.py [--rows qwen3-30b-a3b-32,...] [--markdown] [--breakdown]
        [--no-plan] [--hf]

Each row's model is built on meta as the built-in `moe:` family from the row's shape columns
(`build_model`, the one builder; `--hf` builds its Hugging Face config class instead: MixtralConfig,
Qwen3MoeConfig, GptOssConfig), and priced as published: tp, pp, virtual stages, cp, ep, etp (1 with tp > 1: MoE parallel
folding, solver/expert_folding.py), dp, microbatch, the optimizer sharding
(Megatron's distributed optimizer is ZeRO-1) and recomputation as run, with the load imbalance
the routing implies (force-balanced routing and token dropping at capacity factor c put at most
1.0 and c x the even share on the busiest rank; dropless real routing the planner's default).
Then autopar plans the same model on the same cluster and global batch itself. Both are printed
in the source's unit: TFLOP/s per GPU by the row's FLOP counting (Megatron-Core's
num_floating_point_operations: routed top-k experts only, causal attention halved where the row
says so), or tokens/s per GPU. Pipeline stages are cut as the row's framework cut them
(published_runs.framework_split: Megatron-Core, NeMo and Megatron-Bridge put num_layers / (pp x vp)
layers on each model chunk, the embedding on the first, the output layer and loss on the last;
Megatron-Bridge's gpt_oss recipe sets no account-for-embedding/loss or first/last-stage counts, and
Mixtral 8x22B's 56 layers on pp 8 x vp 7 = 56 chunks leave no room for them). The runs' Megatron-Core
token dispatcher (MoeRun.fused_permute: the flex dispatcher writes rows expert-major in its all-to-all,
the all-to-all dispatcher reorders them around the grouped GEMMs, ep.reorder; with experts split on tp
each tp rank dispatches its share of the rows and the tp group gathers them after the all-to-all,
ExpertPricing.tp_share_dispatch) and distributed optimizer
(bf16 parameter all-gathers, overlapped with the next forward where the recipe sets overlap_param_gather:
published_runs.param_gather_overlapped) are priced as their recipes set them. Where the planner refuses the published configuration, the table
prints the refusal. A row in fp8 (DGX Cloud's Grok 1 FP8 table) runs its linears and experts in float8 with
the casts its framework ran (published_fp8.handling_of: TransformerEngine's for Megatron-Core, each expert a
float8 linear) and is priced as run only: autopar's own plan would cast as autopar's runtime does. The reference
numbers are only read here, to compare.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autopar.solver.experts import DEFAULT_LOAD_IMBALANCE  # noqa: E402 (the planner's default, for dropless real routing)
from benchmarks.published_runs import (as_megatron_saves, megatron_states, param_gather_overlapped, select_rows,  # noqa: E402
                                       split_as_run)

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "published_moe.csv"
MORE = Path(__file__).resolve().parent / "published_moe_more.csv"
"""Published MoE runs beyond the shared sample, in its format (DGX Cloud Benchmarking: v25.02's Grok 1,
v25.05's DeepSeek-V3)."""

_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "dense_layers", "ffn_hidden", "expert_ffn_hidden",
               "num_experts", "top_k", "shared_experts", "vocab", "seq")
_HEAD_DIM_NOTE = re.compile(r"\bhead_dim (\d+)\b")
_CAPACITY = re.compile(r"capacity factor (\d+(?:\.\d+)?)", re.IGNORECASE)
_SLIDING_NOTE = re.compile(r"sliding window (\d+)\b", re.IGNORECASE)
_FUSED_DISPATCH = re.compile(r"\bflex dispatcher|\bDeepEP\b|\bHybridEP\b|moe_recipes", re.IGNORECASE)

PUBLIC_CONFIG = {
    "Qwen3-30B-A3B": dict(head_dim=128),
    "gpt-oss-120b": dict(expert_bias=True, swiglu_limit=7.0),
    "DeepSeek-V3": dict(router="sigmoid", attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128),
}
"""Figures a model's public config.json has and the reference file's columns do not
(Qwen/Qwen3-30B-A3B config.json: head_dim 128, so heads x head_dim = 4096 != hidden 2048;
openai/gpt-oss-120b config.json: the experts' gate_up_proj_bias and down_proj_bias, swiglu_limit 7.0;
deepseek-ai/DeepSeek-V3 config.json: sigmoid scoring, Multi-head Latent Attention's ranks and head dims)."""
_MODEL_KEYS = ("expert_bias", "swiglu_limit", "router", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim")
"""PUBLIC_CONFIG's keys that are `moe:` spec keys beside the shape."""

@dataclass(frozen=True, kw_only=True)
class MoeRun:
    """One row of the reference file."""

    id: str
    source: str
    model_name: str
    shape: dict[str, int]
    head_dim: int
    sliding_window: int | None
    model_keys: dict[str, object]
    """`moe:` keys of the model's public config beyond the shape columns (PUBLIC_CONFIG)."""
    gpus: int
    cluster: str
    global_batch: int
    microbatch: int
    tp: int
    pp: int
    virtual_stages: int
    cp: int
    ep: int
    etp: int
    dp: int
    zero: int
    recompute: str
    recompute_as_run: str
    routing: str
    metric: str
    published: float
    flop_counting: str
    notes: str
    optimizer_sharding: str = ""
    """The optimizer sharding as the row words it (how the distributed optimizer ran)."""
    precision: str = "bf16"
    """"bf16", or "fp8" / "fp8-rowwise": float8 linears and experts, casts as the row's framework ran
    them (published_fp8.handling_of)."""

    @property
    def num_nodes(self) -> int:
        return max(1, self.gpus // 8)

    @property
    def cluster_spec(self) -> str:
        return f"{self.cluster}:nodes={self.num_nodes}"

    @property
    def load_imbalance(self) -> float:
        """The busiest expert rank's tokens over the even share, as the run routed them."""
        if "force-balanced" in self.routing:
            return 1.0
        capacity = _CAPACITY.search(self.routing)
        if capacity and "drop" in self.routing:
            return max(1.0, float(capacity.group(1)))
        return DEFAULT_LOAD_IMBALANCE

    @property
    def fused_permute(self) -> bool:
        """Whether the run's token dispatcher writes the received rows expert-major inside its
        all-to-all (Megatron-Core's flex dispatcher with DeepEP or HybridEP: no reorder pass,
        ExpertPricing.fused_permute): where the row says so, and for the recipes of Megatron-LM's
        examples/moe_recipes, every one of which sets moe_token_dispatcher_type flex (dev branch,
        2026-08; qwen3_30b/h100/bf16_32GPU_TP1PP1EP8.yaml: flex, hybridep). Else Megatron-Core's
        all-to-all dispatcher, which reorders with more than one local expert (Megatron-Bridge's
        gpt_oss recipes; the Megatron-MoE-ModelZoo Mixtral script's DISPATCHER=alltoall)."""
        text = f"{self.source} {self.notes} {self.routing}"
        return bool(_FUSED_DISPATCH.search(text))

    @property
    def family(self) -> str:
        """The Hugging Face config class the model is built from."""
        name = self.model_name.lower()
        for prefix, config in (("mixtral", "MixtralConfig"), ("qwen3", "Qwen3MoeConfig"), ("gpt-oss", "GptOssConfig")):
            if name.startswith(prefix):
                return config
        raise ValueError(f"{self.id}: no Hugging Face config class for model '{self.model_name}'")

    def flops_per_step(self) -> float:
        """Model FLOPs of one step as Megatron-Core counts them (num_floating_point_operations):
        forward x 3; attention projections and scores (causal scores halved where the row's
        flop_counting says so), SwiGLU MLPs of the dense layers, the routed top-k experts' and the
        shared experts' SwiGLU, and the logits; no router, no recomputation."""
        shape = self.shape
        b, s, h = self.global_batch, shape["seq"], shape["hidden"]
        layers, dense = shape["layers"], shape.get("dense_layers", 0)
        heads, groups = shape["heads"], shape.get("kv_heads", shape["heads"])
        projection = heads * self.head_dim / h
        scores = s / 2 if "causal attention halved" in self.flop_counting else s
        attention = 4 * b * s * h * projection * (h + h * groups / heads + scores)
        dense_mlp = 6 * b * s * h * shape.get("ffn_hidden", 0)
        expert = 6 * b * s * h * shape["expert_ffn_hidden"] * (shape["top_k"] + shape.get("shared_experts", 0))
        logits = 2 * b * s * h * shape["vocab"]
        return 3 * (layers * attention + dense * dense_mlp + (layers - dense) * expert + logits)

    def in_unit(self, step_time_s: float) -> float:
        """A step time in the source's unit."""
        if self.metric == "tokens_per_s_per_gpu":
            return self.global_batch * self.shape["seq"] / step_time_s / self.gpus
        if self.metric == "tflops_per_gpu":
            return self.flops_per_step() / step_time_s / self.gpus / 1e12
        if self.metric == "step_time_s":
            return step_time_s
        raise ValueError(f"{self.id}: unknown metric '{self.metric}'")


def read_runs(path: Path = REFERENCE) -> list[MoeRun]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [_run(item) for item in csv.DictReader(lines)]


def _run(item: dict[str, str]) -> MoeRun:
    shape = {key: int(item[key]) for key in _SHAPE_KEYS if item.get(key)}
    notes = item.get("notes", "")
    stated = _HEAD_DIM_NOTE.search(notes)
    public = PUBLIC_CONFIG.get(item["model"], {})
    head_dim = int(stated.group(1)) if stated else public.get("head_dim", shape["hidden"] // shape["heads"])
    window = _SLIDING_NOTE.search(notes)
    model_keys = {key: value for key, value in public.items() if key in _MODEL_KEYS}
    return MoeRun(id=item["id"], source=item["source"], model_name=item["model"], shape=shape, head_dim=head_dim,
                  model_keys=model_keys,
                  sliding_window=int(window.group(1)) if window else None, gpus=int(item["gpus"]),
                  cluster=item["cluster"], global_batch=int(item["global_batch"]), microbatch=int(item["microbatch"]),
                  tp=int(item["tp"]), pp=int(item["pp"]), virtual_stages=int(item["virtual_stages"] or 1),
                  cp=int(item["cp"] or 1), ep=int(item["ep"] or 1), etp=int(item["etp"] or 1), dp=int(item["dp"]),
                  zero=zero_stage(item["optimizer_sharding"]),
                  recompute=as_megatron_saves(recompute_mode(item["recompute"]), int(item["tp"])),
                  recompute_as_run=item["recompute"], routing=item["routing"], metric=item["metric"],
                  published=float(item["published"]), flop_counting=item["flop_counting"], notes=notes,
                  optimizer_sharding=item["optimizer_sharding"], precision=item.get("precision") or "bf16")


def zero_stage(text: str) -> int:
    """Megatron's distributed optimizer shards the optimizer states over dp: ZeRO-1."""
    return 1 if "distributed optimizer" in text.lower() or "zero-1" in text.lower() else 0


_MODULE_WORDS = {"layernorm": "layernorm", "moe activation": "moe_act", "moe_act": "moe_act",
                 "core attention": "core_attn", "core_attn": "core_attn", "mlp": "mlp", "moe": "moe",
                 "mla up projection": "mla_up_proj", "mla_up_proj": "mla_up_proj"}
"""Megatron-Core's --recompute-modules kinds as the reference file writes them."""


def recompute_mode(text: str) -> str:
    """autopar's mode for the run's recomputation: Megatron's selective recompute of named modules
    ("selective (layernorm, MoE activation)", Megatron-Core's --recompute-modules) is autopar's
    "modules:<kinds>"; selective recompute without modules named is autopar's "selective"."""
    text = text.strip().lower()
    if text in ("", "none"):
        return "none"
    named = re.fullmatch(r"selective\s*\((.*)\)", text)
    if named:
        kinds = [_MODULE_WORDS.get(word.strip()) for word in named.group(1).split(",")]
        if kinds and all(kinds):
            return "modules:" + ",".join(kinds)
    return "selective" if text.startswith("selective") else "full" if text.startswith("full") else text


def _token_loss(output, targets):
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


def build_model(run: MoeRun, batch: int = 1, source: str = "builtin"):
    """(model on meta, inputs, targets, loss) of the row (the one builder of this benchmark): the
    built-in `moe:` family from the row's shape columns (`model_spec`; Megatron's layers: SDPA,
    one RMSNorm kernel, SwiGLU experts as grouped matmuls), or with source="hf" the row's Hugging
    Face config class as users build it (unfused fp32 norms and rotary; gpt-oss's sinks make it
    eager attention)."""
    if source == "builtin":
        from autopar.models import build_model as build_builtin

        bundle = build_builtin(model_spec(run), batch_size=batch, device="meta")
        return bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn
    import torch
    import transformers

    from autopar.models import on_meta

    shape = shape_fields(run)
    config = getattr(transformers, run.family)(use_cache=False, **shape)
    model_class = {"MixtralConfig": "MixtralForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
                   "GptOssConfig": "GptOssForCausalLM"}[run.family]
    with on_meta():
        model = getattr(transformers, model_class)(config)
    tokens = torch.zeros(batch, run.shape["seq"], dtype=torch.long, device="meta")
    return model, dict(input_ids=tokens), tokens, _token_loss


def model_spec(run: MoeRun) -> str:
    """The row's model as a built-in `moe:` spec: its shape columns, softmax routing and grouped-query
    attention unless the public config says otherwise (PUBLIC_CONFIG: DeepSeek-V3's sigmoid router
    and latent attention), dropless unless the row dropped tokens at a capacity factor, the sliding
    window the notes name and the public config's expert biases and clamped GLU. Left out:
    gpt-oss's attention sinks and attention and router biases; DeepSeek-V3's group-limited routing."""
    shape = dict(run.shape)
    shape.setdefault("ffn_hidden", shape["expert_ffn_hidden"])
    shape["head_dim"] = run.head_dim
    shape["kv_heads"] = shape.get("kv_heads", shape["heads"])
    capacity = _CAPACITY.search(run.routing)
    shape["capacity_factor"] = capacity.group(1) if capacity and "drop" in run.routing else 0
    fields = ("layers", "hidden", "heads", "kv_heads", "head_dim", "seq", "vocab", "ffn_hidden", "dense_layers",
              "num_experts", "top_k", "expert_ffn_hidden", "shared_experts", "capacity_factor")
    keys = dict({"router": "softmax", "attention": "gqa"}, **run.model_keys,
                **({"sliding_window": run.sliding_window} if run.sliding_window else {}))
    if keys["attention"] == "mla":  # latent attention has no kv heads or head_dim of its own
        fields = tuple(field for field in fields if field not in ("kv_heads", "head_dim"))
    extra = "".join(f",{key}={str(value).lower()}" for key, value in keys.items())
    return "moe:" + ",".join(f"{key}={shape[key]}" for key in fields if key in shape) + extra


def shape_fields(run: MoeRun) -> dict:
    """The config fields of the row's shape, by config class."""
    shape = run.shape
    common = dict(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape.get("kv_heads", shape["heads"]), vocab_size=shape["vocab"],
                  max_position_embeddings=shape["seq"], num_experts_per_tok=shape["top_k"], head_dim=run.head_dim,
                  tie_word_embeddings=False)
    if shape.get("shared_experts"):
        raise ValueError(f"{run.id}: shared experts are not built here")
    if run.family == "MixtralConfig":
        return dict(common, intermediate_size=shape["expert_ffn_hidden"], num_local_experts=shape["num_experts"])
    if run.family == "Qwen3MoeConfig":
        dense = shape.get("dense_layers", 0)
        return dict(common, moe_intermediate_size=shape["expert_ffn_hidden"], num_experts=shape["num_experts"],
                    intermediate_size=shape.get("ffn_hidden") or shape["expert_ffn_hidden"],
                    mlp_only_layers=list(range(dense)), decoder_sparse_step=1, norm_topk_prob=True)
    return dict(common, intermediate_size=shape["expert_ffn_hidden"], num_local_experts=shape["num_experts"],
                **({"sliding_window": run.sliding_window} if run.sliding_window else {}))


@dataclass(frozen=True, kw_only=True)
class Outcome:
    run: MoeRun
    expert_ops: str
    published_step_s: float | None
    """The published configuration's predicted step (None: refused or unpriced)."""
    published_fits: bool
    refusal: str
    plan: str
    plan_step_s: float | None
    seconds: float
    breakdown: dict[str, float]
    zero0: tuple[float, bool] | None = None
    """Where the published ZeRO-1 was refused with ep: (step, fits) of the same configuration with
    ZeRO-0 (unsharded optimizer states), the nearest one priced today."""

    def error(self) -> float | None:
        if self.published_step_s is None:
            return None
        return self.run.in_unit(self.published_step_s) / self.run.published - 1

    def zero0_error(self) -> float | None:
        return None if self.zero0 is None else self.run.in_unit(self.zero0[0]) / self.run.published - 1


def planner_for(run: MoeRun, source: str = "builtin"):
    """(a Planner of the row's model on its cluster and batch, the attention it runs: SDPA for the
    built-in family; a Hugging Face model's implementation, "eager" materializing the scores as
    gpt-oss's attention sinks do)."""
    from autopar.cluster import Cluster
    from autopar.plans.planning import capture_for_planning
    from autopar.solver.experts import ExpertPricing
    from autopar.solver.search import Planner, SearchOptions

    model, inputs, targets, loss = build_model(run, source=source)
    graph = capture_for_planning(model, inputs, loss_fn=loss, example_targets=targets)
    attention = model.config._attn_implementation if source == "hf" else "sdpa"
    # Megatron-Core's dispatchers send each tp rank's share of the rows (tp_share_dispatch: only where
    # the experts are split on tp, etp = tp > 1)
    options = SearchOptions(experts=ExpertPricing(load_imbalance=run.load_imbalance, fused_permute=run.fused_permute,
                                                  tp_share_dispatch=True),
                            jobs=1)
    policy = replace(megatron_states(run.source, f"{run.notes} {run.optimizer_sharding}", run.precision),
                     param_gather_overlap=param_gather_overlapped(f"{run.source} {run.notes} {run.optimizer_sharding}"))
    planner = Planner(graph, Cluster.from_spec(run.cluster_spec), global_batch=run.global_batch, policy=policy,
                      precision="fp8" if run.precision.startswith("fp8") else "bf16", fp8=fp8_choice(run, graph),
                      options=options)
    return planner, attention


def fp8_choice(run: MoeRun, graph):
    """What an fp8 row runs in float8 (None for bf16): every linear and expert weight solver/fp8.py's
    rule puts there, in the row's recipe, the casts as its framework ran them (published_fp8.py)."""
    from autopar.solver.fp8 import Fp8Choice, fp8_experts, fp8_linears
    from benchmarks.published_fp8 import handling_of, recipe_of

    if not run.precision.startswith("fp8"):
        return None
    experts, experts_in_bf16 = fp8_experts(graph)
    return Fp8Choice(recipe=recipe_of(run), linears=fp8_linears(graph), experts=experts,
                     experts_in_bf16=experts_in_bf16, handling=handling_of(run))


def evaluate_run(run: MoeRun, plan: bool = True, source: str = "builtin") -> Outcome:
    from autopar import api
    from autopar.errors import AutoparError
    from autopar.plans.planning import plan_with
    from autopar.solver.experts import find_expert_ops

    started = time.perf_counter()
    planner, attention = planner_for(run, source)
    ops = find_expert_ops(planner.graph)
    kinds = sorted({op.kind for op in ops})
    expert_ops = (f"{len(ops)} {'/'.join(kinds)}" if ops else "none found") + f"; attention {attention}"
    step_s, fits, refusal, breakdown, nearest = None, False, "", {}, None

    def price(zero: int):
        interleaved = run.virtual_stages > 1
        config = api.fixed_config(planner, tp=run.tp, pp=run.pp, dp=run.dp, microbatch_size=run.microbatch,
                                  schedule="interleaved" if interleaved else "1f1b",
                                  virtual_stages=run.virtual_stages if interleaved else None,
                                  layers_per_virtual_stage=None, recompute=run.recompute, zero_stage=zero,
                                  ep=run.ep, cp=run.cp, etp=run.etp, pipeline_split=split_as_run(run, planner.graph))
        return planner.evaluate(config)[0]

    try:
        estimate = price(run.zero)
        step_s, fits, breakdown = estimate.step_time_s, estimate.fits, dict(estimate.breakdown_s)
    except AutoparError as error:
        refusal = " ".join(str(error).split())
        if run.zero and "ZeRO-0" in refusal:  # the nearest configuration the planner prices today
            try:
                estimate = price(0)
                nearest, breakdown = (estimate.step_time_s, estimate.fits), dict(estimate.breakdown_s)
            except AutoparError:
                pass
    chosen, chosen_s = "-", None
    if plan and run.precision == "bf16":  # an fp8 row's casts are its framework's, not autopar's runtime's
        try:
            found = plan_with(planner)
            mesh = found.mesh
            chosen = (f"tp={mesh['tp']} pp={mesh['pp']} dp={mesh['dp']}" + (f" cp={mesh['cp']}" if mesh["cp"] > 1 else "")
                      + f" ep={found.ep} mb={found.microbatch_size} {found.schedule}"
                      + (f"(v={found.virtual_stages})" if found.virtual_stages > 1 else "")
                      + f" {found.recompute} ZeRO-{found.zero_stage}")
            chosen_s = found.predicted.step_time_s
        except AutoparError as error:
            chosen = "refused: " + " ".join(str(error).split())
    return Outcome(run=run, expert_ops=expert_ops, published_step_s=step_s, published_fits=fits, refusal=refusal,
                   plan=chosen, plan_step_s=chosen_s, seconds=time.perf_counter() - started, breakdown=breakdown,
                   zero0=nearest)


HEADER = ("run", "unit", "published", "expert ops", "as published: predicted", "error", "fits",
          "same with ZeRO-0 (where ZeRO-1 refused)", "autopar's plan", "its prediction", "vs published", "time (s)")


def row_cells(outcome: Outcome) -> tuple[str, ...]:
    run = outcome.run
    if outcome.published_step_s is None:
        predicted, error, fits = f"refused: {outcome.refusal}", "-", "-"
    else:
        predicted = f"{run.in_unit(outcome.published_step_s):.4g} (step {outcome.published_step_s:.3g} s, "  \
                    f"imbalance {run.load_imbalance:g})"
        error, fits = f"{100 * outcome.error():+.1f}%", "yes" if outcome.published_fits else "NO"
    if outcome.zero0 is None:
        zero0 = "-"
    else:
        zero0 = (f"{run.in_unit(outcome.zero0[0]):.4g} ({100 * outcome.zero0_error():+.1f}%, "
                 f"{'fits' if outcome.zero0[1] else 'does NOT fit'})")
    plan_value = "-" if outcome.plan_step_s is None else f"{run.in_unit(outcome.plan_step_s):.4g}"
    plan_gain = "-" if outcome.plan_step_s is None else f"{100 * (run.in_unit(outcome.plan_step_s) / run.published - 1):+.1f}%"
    return (run.id, run.metric, f"{run.published:g}", outcome.expert_ops, predicted, error, fits, zero0, outcome.plan,
            plan_value, plan_gain, f"{outcome.seconds:.0f}")


def markdown(outcomes: list[Outcome]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row_cells(outcome)) + " |" for outcome in outcomes]
    return "\n".join(lines)


def plain(outcomes: list[Outcome]) -> str:
    return "\n\n".join("\n".join(f"{name:>24}: {cell}" for name, cell in zip(HEADER, row_cells(outcome)))
                       for outcome in outcomes)


def _has_hf_class(run: MoeRun) -> bool:
    try:
        return bool(run.family)
    except ValueError:
        print(f"{run.id}: skipped with --hf (no Hugging Face config class for {run.model_name})", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print one markdown table")
    parser.add_argument("--breakdown", action="store_true", help="also print the as-published step's breakdown")
    parser.add_argument("--no-plan", action="store_true", help="price the published configurations only")
    parser.add_argument("--hf", action="store_true", help="build each model from its Hugging Face config class "
                        "instead of the built-in moe: family")
    args = parser.parse_args(argv)
    runs = select_rows((read_runs() if REFERENCE.exists() else []) + read_runs(MORE), args.rows)
    if args.hf:  # a model without a Hugging Face config class (Grok 1) is priced built-in only
        runs = [run for run in runs if _has_hf_class(run)]
    outcomes = []
    for run in runs:
        outcome = evaluate_run(run, plan=not args.no_plan, source="hf" if args.hf else "builtin")
        outcomes.append(outcome)
        if not args.markdown:
            print(plain([outcome]) + "\n", flush=True)
        if args.breakdown and outcome.breakdown:
            parts = ", ".join(f"{name} {seconds:.3g}" for name, seconds in outcome.breakdown.items() if seconds)
            print(f"  {run.id} step breakdown (s): {parts}\n", flush=True)
    if args.markdown:
        print(markdown(outcomes))
    errors = [abs(e) for e in (outcome.error() for outcome in outcomes) if e is not None]
    if errors:
        print(f"\nas published: median absolute error {100 * statistics.median(errors):.1f}%, "
              f"{len(errors)} of {len(outcomes)} rows priced")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planning a model end to end: capture (cached), search, build the Plan; `plan`, `evaluate` and
candidate plans for trials. `autopar.api` is the public face of these and of `parallelize`.

    plan = autopar.plan(model, example_inputs, "dgx-a100-80g:nodes=16", global_batch=1024)
    print(plan.summary())

`model` is an nn.Module (any device, `meta` included), a registry spec ("gpt3-175b",
"gpt:layers=4,hidden=256", "file.py:factory") or an already captured OpGraph. Planning
captures a weightless bf16 replica (the compute precision of the default policy), so neither
the user's weights nor their dtype matter.
"""

from __future__ import annotations

import importlib
import itertools
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autopar.capture import cache as capture_cache
from autopar.capture.block_reuse import capture_reusing_blocks
from autopar.capture.export import capture, targets_like_output
from autopar.capture.failures import without_stack_traces
from autopar.capture.heap import collector_paused, freeze_more, frozen_heap
from autopar.capture.replica import meta_inputs, meta_replica
from autopar.cluster import Cluster
from autopar.errors import CaptureError, ConfigError
from autopar.graph import OpGraph
from autopar.plans.build import make_plan
from autopar.plans.plan import Plan
from autopar.solver.constraints import (Constraints, check_constraint_values, check_degrees, check_fixed_config,
                                        check_pipeline_depth, search_etp)
from autopar.solver.expert_folding import runtime_blocker
from autopar.solver.experts import ExpertPricing, check_load_imbalance
from autopar.solver.fp8 import FP8_CASTS, FP8_RECIPES, Fp8Choice, fp8_experts, fp8_linears
from autopar.solver.overheads import overheads_for
from autopar.solver.parallel_search import check_jobs_env
from autopar.solver.pipeline import check_pipeline_split
from autopar.solver.search import Planner, SearchOptions
from autopar.solver.step_model import ParallelConfig
from autopar.validation import check_choice, check_global_batch, shorten, type_name
from cost_model.memory import BF16_ADAM, FP32_ADAM, PrecisionPolicy

PRECISIONS = {"bf16": BF16_ADAM, "fp32": FP32_ADAM, "fp8": BF16_ADAM}
"""Precision policies by name; "fp8" keeps bf16's memory policy (fp32 master weights and Adam, bf16
activations): its float8 copies and casts are priced as fp8 terms (solver/fp8.py)."""


@dataclass(frozen=True, kw_only=True)
class ModelInput:
    """A model with what capture needs besides it."""

    name: str
    model: nn.Module
    example_inputs: tuple
    example_kwargs: dict = field(default_factory=dict)
    """Keyword inputs of the forward (`input_ids=`, `attention_mask=`...), in call order."""
    loss_fn: Callable | None = None
    example_targets: Any = None


def split_inputs(example_inputs, example_kwargs=None) -> tuple[tuple, dict]:
    """(positional, keyword) inputs: `example_inputs` is a tuple, one tensor, or a mapping of
    keyword inputs (`dict(input_ids=..., attention_mask=...)`, a tokenizer's batch)."""
    keywords = dict(example_kwargs or {})
    if isinstance(example_inputs, Mapping):
        return (), {**dict(example_inputs), **keywords}
    if example_inputs is None:
        return (), keywords
    return (tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)), keywords


def resolve_model(model, example_inputs=None, *, loss_fn=None, example_targets=None, example_kwargs=None,
                  batch_size: int = 2) -> ModelInput:
    """Accepts an nn.Module with example inputs (positional and/or keyword), or a registry spec string."""
    if isinstance(model, str):
        from autopar.models import build_model

        bundle = build_model(model, batch_size=batch_size, device="meta")
        return ModelInput(name=bundle.name, model=bundle.model, example_inputs=tuple(bundle.example_inputs),
                          loss_fn=loss_fn or bundle.loss_fn,
                          example_targets=example_targets if example_targets is not None else bundle.example_targets)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module, a model spec string or an OpGraph, got {type_name(model)}")
    if example_inputs is None and not example_kwargs:
        raise ConfigError("example_inputs are required with an nn.Module: a tuple of tensors like one training batch "
                          "(or a dict of keyword inputs, or example_kwargs=)")
    inputs, keywords = split_inputs(example_inputs, example_kwargs)
    return ModelInput(name=type(model).__name__, model=model, example_inputs=inputs, example_kwargs=keywords,
                      loss_fn=loss_fn, example_targets=example_targets)


def check_model_arguments(model, example_inputs=None, loss_fn=None, example_targets=None) -> None:
    """What a model and its example batch must be, said before anything is traced (a str given
    as inputs is a mistake to name, not a capture failure)."""
    if isinstance(model, type) or not isinstance(model, (str, nn.Module, OpGraph)):
        raise ConfigError(f"model must be an nn.Module instance, a model spec string such as 'gpt:layers=4' or an "
                          f"OpGraph, got {type_name(model)} {shorten(model) if not isinstance(model, type) else ''}")
    if example_inputs is not None and not isinstance(example_inputs, (torch.Tensor, tuple, list, Mapping)):
        raise ConfigError(f"example_inputs must be a tensor, a tuple of tensors like one training batch (the "
                          f"model is called as model(*example_inputs)) or a dict of keyword inputs, got "
                          f"{type_name(example_inputs)} "
                          f"{shorten(example_inputs)}")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be a callable loss_fn(output, targets) such as "
                          f"torch.nn.functional.mse_loss, got {type_name(loss_fn)} {shorten(loss_fn)}")
    if example_targets is not None and not isinstance(example_targets, (torch.Tensor, tuple, list, dict)):
        raise ConfigError(f"example_targets must be a tensor (or a tuple of them) like the targets of one batch, "
                          f"got {type_name(example_targets)} {shorten(example_targets)}")


@frozen_heap()  # building the model, the import of export's stack and the trace: see heap.py
def capture_for_planning(model, example_inputs=None, *, loss_fn=None, example_targets=None, example_kwargs=None,
                         precision: str = "bf16", verbose: bool = False, reuse_blocks: bool = True,
                         cache: bool | None = None) -> OpGraph:
    """Capture a weightless replica of the model in the compute precision.

    With `reuse_blocks` repeating blocks are traced for three periods and copied for the rest
    (block_reuse.py): the same graph as tracing them all, in a fraction of the time. With
    `cache` (None: on unless AUTOPAR_CAPTURE_CACHE=0) a capture made before from the same
    model, inputs and code is loaded from the capture cache (capture_cache.py)."""
    check_model_arguments(model, example_inputs, loss_fn, example_targets)
    _policy(precision)
    if isinstance(model, OpGraph):
        return model
    use_cache = capture_cache.enabled() if cache is None else bool(cache)
    log = _progress(verbose) or (lambda message: None)
    key, spec = None, None
    if use_cache and isinstance(model, str) and example_inputs is None and not example_kwargs:
        from autopar.models import resolve_spec

        resolved = resolve_spec(model)
        if resolved.family is not None:  # autopar's own model: keyed by its spec, nothing built
            key = capture_cache.spec_key(resolved, loss_fn=loss_fn, example_targets=example_targets,
                                         precision=precision, reuse_blocks=reuse_blocks)
    if key is None:
        spec = resolve_model(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                             example_kwargs=example_kwargs)
        if use_cache:
            key = capture_cache.module_key(spec.model, spec.example_inputs, spec.example_kwargs, name=spec.name,
                                           loss_fn=spec.loss_fn,
                                           example_targets=spec.example_targets, precision=precision,
                                           reuse_blocks=reuse_blocks)
            if key is None:
                log("capture: not cached (the model holds state the capture cache cannot key for certain)")
    if key is not None:
        graph = capture_cache.lookup(key)
        if graph is not None:
            log(f"capture: loaded from the capture cache ({capture_cache.entry_path(key)}; "
                f"AUTOPAR_CAPTURE_CACHE=0 or --no-capture-cache traces again)")
            return graph
    if spec is None:
        spec = resolve_model(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                             example_kwargs=example_kwargs)
    graph = _capture_replica(model, spec, precision, verbose, reuse_blocks)
    if key is not None:
        stored = capture_cache.store(key, graph)
        log(f"capture: saved to the capture cache ({stored})" if stored else
            f"capture: the capture cache folder {capture_cache.cache_dir()} cannot be written; not cached")
    return graph


def _capture_replica(model, spec: ModelInput, precision: str, verbose: bool, reuse_blocks: bool) -> OpGraph:
    with collector_paused():
        importlib.import_module("torch.export._trace")  # export's stack (torch._dynamo), else its first use's
        freeze_more()  # its 300,000 objects, before a collection walks them
    with without_stack_traces():
        return _traced_replica(model, spec, precision, verbose, reuse_blocks)


def _traced_replica(model, spec: ModelInput, precision: str, verbose: bool, reuse_blocks: bool) -> OpGraph:
    dtype = torch.bfloat16 if precision in ("bf16", "fp8") else None
    if _built_here(model, spec.model):
        # A built-in family's model was just built on meta and nobody else holds it: converting
        # it in place spares copying every module (a fifth of GPT-3 175B's capture).
        replica = spec.model.to(dtype) if dtype is not None else spec.model
    else:  # the user's model (or a file factory's) is never touched: its replica is a copy
        replica = meta_replica(spec.model, dtype)
    inputs, keywords = meta_inputs(spec.example_inputs, dtype), meta_inputs(spec.example_kwargs, dtype)
    targets = meta_inputs(spec.example_targets) if spec.example_targets is not None else None
    try:
        if reuse_blocks:
            graph = capture_reusing_blocks(replica, inputs, keywords, loss_fn=spec.loss_fn, example_targets=targets,
                                           name=spec.name, verbose=verbose)
            if graph is not None:
                return graph
        if spec.loss_fn is not None and targets is None:
            targets = targets_like_output(replica, inputs, keywords)
        return capture(replica, inputs, keywords, loss_fn=spec.loss_fn, example_targets=targets, name=spec.name,
                       verbose=verbose)
    except CaptureError as error:
        if "device" not in str(error) or _on_meta(spec.model):
            raise
    # The forward makes tensors on a fixed device (torch.ones(n) on the CPU), which meets the
    # meta replica's tensors: trace the model itself (export still allocates no activations).
    targets = spec.example_targets
    if spec.loss_fn is not None and targets is None:
        targets = targets_like_output(spec.model, spec.example_inputs, spec.example_kwargs)
    graph = capture(spec.model, spec.example_inputs, spec.example_kwargs, loss_fn=spec.loss_fn,
                    example_targets=targets, name=spec.name, verbose=verbose)
    note = "captured on the model's own device and dtype: its forward creates tensors on a fixed device"
    return replace(graph, notes=graph.notes + (note,))


def _built_here(model, built: nn.Module) -> bool:
    """`built` is a registry family's model that resolve_model made from the spec `model`, on meta."""
    if not isinstance(model, str):
        return False
    from autopar.models import resolve_spec

    return resolve_spec(model).family is not None and all(
        tensor.is_meta for tensor in itertools.chain(built.parameters(), built.buffers()))


def _on_meta(model: nn.Module) -> bool:
    return any(param.device.type == "meta" for param in model.parameters())


def _policy(precision: str) -> PrecisionPolicy:
    return PRECISIONS[check_choice(precision, "precision", tuple(PRECISIONS))]


def check_fp8_arguments(precision: str, fp8_recipe: str, fp8_filter, fp8_casts: str | None = None) -> None:
    check_choice(fp8_recipe, "fp8_recipe", FP8_RECIPES)
    if precision != "fp8" and fp8_recipe != FP8_RECIPES[0]:
        raise ConfigError(f"fp8_recipe {fp8_recipe!r} chooses the scaling of precision 'fp8', but precision is "
                          f"{precision!r}: pass precision='fp8' or drop fp8_recipe")
    if fp8_casts is not None:
        check_choice(fp8_casts, "fp8_casts", FP8_CASTS)
        if precision != "fp8":
            raise ConfigError(f"fp8_casts says how precision 'fp8' runs its casts, but precision is {precision!r}: "
                              "pass precision='fp8' or drop fp8_casts")
    if fp8_filter is not None and not callable(fp8_filter):
        raise ConfigError(f"fp8_filter must be a callable fp8_filter(module_fqn, weight_shape) -> bool, got "
                          f"{type_name(fp8_filter)} {shorten(fp8_filter)}")
    if precision != "fp8" and fp8_filter is not None:
        raise ConfigError(f"fp8_filter chooses the linears of precision 'fp8', but precision is {precision!r}: "
                          "pass precision='fp8' or drop fp8_filter")


def checked_fp8_filter(fp8_filter):
    """The user's fp8_filter as solver/fp8.py calls it (it replaces the default rule, dims included):
    what it raises is refused naming the weight it was asked about."""
    if fp8_filter is None:
        return None

    def keep(fqn: str, shape: tuple[int, ...]) -> bool:
        try:
            kept = fp8_filter(fqn, shape)
        except Exception as error:  # noqa: BLE001 - the user's code: any failure is theirs to fix
            raise ConfigError(f"fp8_filter({fqn!r}, {shape}) raised {type(error).__name__}: {error}; autopar calls it "
                              "as fp8_filter(module_fqn, weight_shape) -> bool") from error
        return bool(kept)

    return keep


def check_fp8_device(cluster: Cluster, precision: str) -> None:
    """Precision "fp8" needs FP8 tensor cores (H100, H200, B200...) or a CPU cluster (emulated)."""
    if precision != "fp8" or cluster.device_kind == "cpu" or cluster.device.has_fp8:
        return
    raise ConfigError(f"precision 'fp8' needs FP8 tensor cores, and the cluster's {cluster.device.name} has none "
                      "(torch._scaled_mm runs on compute capability 8.9+: H100, H200, B200, L4, L40S; A100 and V100 do "
                      "not): use --precision bf16, or plan for a cluster of such GPUs")


def default_fp8_casts(cluster: Cluster) -> str:
    """How the runtime runs the float8 casts unless told: compiled on GPUs (torch.compile fuses
    them, codegen/fp8_compile.py), eager on CPU clusters (emulated float8, where compiling every
    linear would cost more than the short runs it serves)."""
    return "eager" if cluster.device_kind == "cpu" else "compiled"


TP_OVERLAPS = ("async", "off")
"""How the runtime runs the sequence-parallel all-gathers and reduce-scatters (Plan.tp_overlap)."""


def default_tp_overlap(cluster: Cluster, precision: str) -> str:
    """"async" on CUDA clusters (torch's symmetric-memory ops, codegen/async_tp.py), except precision
    "fp8" (torchao runs its float8 linears), else "off"."""
    return "async" if cluster.device_kind == "cuda" and precision != "fp8" else "off"


def check_tp_overlap(tp_overlap: str | None, cluster: Cluster, precision: str) -> str:
    """The tp_overlap to plan with (None: default_tp_overlap); ConfigError for one the runtime cannot run."""
    if tp_overlap is None:
        return default_tp_overlap(cluster, precision)
    check_choice(tp_overlap, "tp_overlap", TP_OVERLAPS)
    if tp_overlap == "async" and (cluster.device_kind != "cuda" or precision == "fp8"):
        where = "precision 'fp8' (torchao runs its float8 linears)" if precision == "fp8" else \
            f"a {cluster.device_kind} cluster (torch's async TP runs on CUDA symmetric memory)"
        raise ConfigError(f"tp_overlap='async' cannot run on {where}: use tp_overlap='off'")
    return tp_overlap


def check_async_needs_sp(tp_overlap: str | None, sequence_parallel) -> None:
    """"async" overlaps sequence parallelism's collectives: refused with sequence_parallel=False."""
    if tp_overlap == "async" and sequence_parallel is False:
        raise ConfigError("tp_overlap='async' overlaps the all-gathers and reduce-scatters of sequence parallelism, "
                          "and sequence_parallel=False has none: allow sequence parallelism or use tp_overlap='off'")


def tp_overlap_of(planner: Planner, config: ParallelConfig) -> str:
    """The plan's tp_overlap: "async" where the planner priced it and the plan has SP with tp > 1."""
    return "async" if planner.policy.tp_comm_overlap and config.sequence_parallel and config.tp > 1 else "off"


def _progress(verbose: bool):
    return (lambda message: print(message, file=sys.stderr, flush=True)) if verbose else None


def planner_for(model, example_inputs, cluster, *, global_batch: int, loss_fn=None, example_targets=None,
                precision: str = "bf16", options: SearchOptions | None = None, verbose: bool = False,
                calibrated: bool = True, example_kwargs=None, moe_load_imbalance: float | None = None,
                fp8_recipe: str = "tensorwise", fp8_filter=None, fp8_casts: str | None = None,
                tp_overlap: str | None = None) -> Planner:
    """Capture once and return a Planner that can search and price many configurations.

    With `calibrated` (the default) the profile's whole-step calibration, if it has one, adds
    its terms to every prediction (autopar/solver/overheads.py). `moe_load_imbalance` (None: the
    options' own, 1.25 by default) is what the busiest expert-parallel rank gets over the even
    share of a dropless MoE layer's tokens (1.0: balanced routing). Precision "fp8" runs the linears
    solver/fp8.py chooses (or those `fp8_filter(module_fqn, weight_shape)` keeps) with torchao's
    `fp8_recipe` ("tensorwise" or "rowwise"), its casts run and priced as `fp8_casts` says
    ("compiled" or "eager"; None: default_fp8_casts). `tp_overlap` says how the runtime runs the
    sequence-parallel collectives, and how they are priced: "async" (fused with their GEMMs,
    codegen/async_tp.py, priced by solver/tp_overlap.py), "off" (DTensor's, exposed); None:
    default_tp_overlap."""
    policy = _policy(precision)
    check_fp8_arguments(precision, fp8_recipe, fp8_filter, fp8_casts)
    global_batch = check_global_batch(global_batch)
    if options is not None and not isinstance(options, SearchOptions):
        raise ConfigError(f"options must be a SearchOptions or None, got {type_name(options)} {shorten(options)}")
    if not isinstance(verbose, bool):
        raise ConfigError(f"verbose must be a bool, got {type_name(verbose)} {shorten(verbose)}")
    options = _with_load_imbalance(options or SearchOptions(), moe_load_imbalance)
    check_model_arguments(model, example_inputs, loss_fn, example_targets)
    cluster = Cluster.from_spec(cluster)
    overheads = overheads_for(cluster, torch_version=torch.__version__, host=socket.gethostname()) if calibrated \
        else None
    check_fp8_device(cluster, precision)
    overlap = check_tp_overlap(tp_overlap, cluster, precision)
    policy = policy.with_torch_async_tp(overlap == "async")
    graph = capture_for_planning(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                                 example_kwargs=example_kwargs, precision="bf16" if precision == "fp8" else precision,
                                 verbose=verbose)
    keep = checked_fp8_filter(fp8_filter)
    experts, experts_in_bf16 = fp8_experts(graph, keep) if precision == "fp8" else ((), ())
    fp8 = Fp8Choice(recipe=fp8_recipe, linears=fp8_linears(graph, keep), experts=experts,
                    experts_in_bf16=experts_in_bf16, handling=fp8_casts or default_fp8_casts(cluster),
                    auto=fp8_filter is None and cluster.device.has_fp8) if precision == "fp8" else None
    return Planner(graph, cluster, global_batch=global_batch, policy=policy, precision=precision,
                   options=options, progress=_progress(verbose), overheads=overheads, fp8=fp8)


def _with_load_imbalance(options: SearchOptions, moe_load_imbalance: float | None) -> SearchOptions:
    if moe_load_imbalance is None:
        return options
    return replace(options, experts=ExpertPricing(load_imbalance=check_load_imbalance(moe_load_imbalance)))


def plan(model, example_inputs=None, cluster="cpu", *, global_batch: int, constraints=None, loss_fn=None,
         example_targets=None, precision: str = "bf16", options: SearchOptions | None = None,
         verbose: bool = False, example_kwargs=None, moe_load_imbalance: float | None = None,
         fp8_recipe: str = "tensorwise", fp8_filter=None, fp8_casts: str | None = None,
         tp_overlap: str | None = None) -> Plan:
    """Search the best parallelization; `constraints` may fix dp, tp, pp, cp, microbatch_size,
    schedule, virtual_stages / layers_per_virtual_stage, recompute, zero_stage, ep, etp (the search plans etp
    in {1, tp}: etp=1 keeps MoE parallel folding, searched where the runtime runs it, and tp=1; etp=k > 1
    pins tp=k), offload,
    sequence_parallel (False: tensor parallelism without sequence parallelism) and pipeline_split
    ("balanced", autopar's cut, by default; "uniform", "uniform:embedding,head", "first=N,last=M": by
    count, as the frameworks cut, solver/pipeline.py).
    `example_inputs` may be a dict of keyword inputs; `example_kwargs` adds keywords to positional ones.
    `moe_load_imbalance` (>= 1.0; default 1.25) prices dropless MoE routing: what the busiest
    expert-parallel rank receives and computes over the even share (1.0: balanced routing).
    `precision="fp8"` trains the eligible linears in float8 with torchao (`fp8_recipe`, `fp8_filter`,
    `fp8_casts`: see `planner_for`); `tp_overlap` ("async" | "off"; None: "async" on CUDA clusters) too."""
    return candidate_plans(model, example_inputs, cluster, global_batch=global_batch, num_candidates=1,
                           constraints=constraints, loss_fn=loss_fn, example_targets=example_targets,
                           precision=precision, options=options, verbose=verbose, example_kwargs=example_kwargs,
                           moe_load_imbalance=moe_load_imbalance, fp8_recipe=fp8_recipe, fp8_filter=fp8_filter,
                           fp8_casts=fp8_casts, tp_overlap=tp_overlap)[0]


def _check_constraints(cluster: Cluster, global_batch: int, constraints: Constraints) -> None:
    """Fixed degrees the cluster and batch refuse; a tp pinned by etp > 1 (search_etp) is named as
    the etp the user gave."""
    try:
        check_degrees(cluster, global_batch, dp=constraints.dp, tp=constraints.tp, pp=constraints.pp,
                      microbatch_size=constraints.microbatch_size, schedule=constraints.schedule, cp=constraints.cp)
    except ConfigError as error:
        if constraints.etp is not None and constraints.etp > 1 and f"tp={constraints.etp}" in str(error):
            raise ConfigError(f"etp={constraints.etp} runs the experts on tp={constraints.etp} ranks, and {error}") \
                from None
        raise


def plan_with(planner: Planner, constraints: Constraints = Constraints()) -> Plan:
    return candidates_with(planner, constraints, num_candidates=1)[0]


def candidate_plans(model, example_inputs=None, cluster="cpu", *, global_batch: int, num_candidates: int,
                    constraints=None, loss_fn=None, example_targets=None, precision: str = "bf16",
                    options: SearchOptions | None = None, verbose: bool = False, example_kwargs=None,
                    moe_load_imbalance: float | None = None, fp8_recipe: str = "tensorwise",
                    fp8_filter=None, fp8_casts: str | None = None, tp_overlap: str | None = None) -> list[Plan]:
    """The `num_candidates` fastest predicted plans, fastest first (what trials measure)."""
    if moe_load_imbalance is not None:
        check_load_imbalance(moe_load_imbalance)
    constraints = search_etp(Constraints.from_value(check_constraint_values(constraints)))
    check_async_needs_sp(tp_overlap, constraints.sequence_parallel)
    check_model_arguments(model, example_inputs, loss_fn, example_targets)
    check_jobs_env()
    cluster = Cluster.from_spec(cluster)
    _check_constraints(cluster, check_global_batch(global_batch), constraints)
    planner = planner_for(model, example_inputs, cluster, global_batch=global_batch, loss_fn=loss_fn,
                          example_targets=example_targets, precision=precision, options=options, verbose=verbose,
                          example_kwargs=example_kwargs, moe_load_imbalance=moe_load_imbalance,
                          fp8_recipe=fp8_recipe, fp8_filter=fp8_filter, fp8_casts=fp8_casts, tp_overlap=tp_overlap)
    return candidates_with(planner, constraints, num_candidates=num_candidates)


def candidates_with(planner: Planner, constraints: Constraints = Constraints(), *,
                    num_candidates: int = 1) -> list[Plan]:
    if num_candidates < 1:
        raise ConfigError(f"the number of candidate plans must be >= 1, got {num_candidates}")
    constraints = search_etp(constraints)
    _check_constraints(planner.cluster, planner.global_batch, constraints)
    check_pipeline_depth(planner.graph, constraints.pp)
    with frozen_heap():
        return _candidates(planner, constraints, num_candidates)


def _candidates(planner: Planner, constraints: Constraints, num_candidates: int) -> list[Plan]:
    result = planner.search(constraints, keep=max(5, 4 * num_candidates))
    plans = []
    for estimate in _distinct(result.ranked)[:num_candidates]:
        config = estimate.config
        plan = make_plan(planner.graph, planner.cluster, global_batch=planner.global_batch, estimate=estimate,
                         sharding=planner.sharding(config.tp, config.microbatch_size, config.sequence_parallel,
                                                   config.folds_experts),
                         memory_budget_bytes=planner.step_model.memory_budget_bytes,
                         search=result if estimate is result.best else None, precision=planner.precision,
                         tp_overlap=tp_overlap_of(planner, config),
                         moe_load_imbalance=planner.moe_load_imbalance, fp8=_fp8_of(planner, config),
                         segments=planner.segment_costs(config.tp, config.microbatch_size, config.cp,
                                                        config.sequence_parallel, config.folds_experts),
                         strategies=planner.strategies(config.tp, config.microbatch_size, config.sequence_parallel,
                                                       config.folds_experts))
        plans.append(_with_error_bar(plan, planner))
    return plans


def _fp8_of(planner: Planner, config: ParallelConfig) -> Fp8Choice | None:
    """Precision "fp8": the linears that run in float8 under `config` (the planner's choice where
    it chooses: fp8_pricing.Fp8Pricing.chosen)."""
    if planner.fp8 is None or planner.pricing.fp8 is None:
        return planner.fp8
    strategies = lambda chosen: planner.pricing.strategies(  # noqa: E731
        chosen.tp, chosen.microbatch_size, chosen.sequence_parallel, chosen.folds_experts)
    return replace(planner.fp8, linears=planner.pricing.fp8.chosen(config, strategies),
                   experts=planner.pricing.fp8.chosen_experts(config, strategies))


def _distinct(ranked: list) -> list:
    """Estimates that differ in more than the recomputation mode (the fastest of each): trials
    of two configurations that run alike would spend the trial budget on one choice twice."""
    seen, kept = set(), []
    for estimate in ranked:
        config = estimate.config
        key = (config.dp, config.tp, config.pp, config.cp, config.microbatch_size, config.schedule,
               config.virtual_stages, config.zero_stage, config.ep, config.offload, config.sequence_parallel)
        if key not in seen:
            seen.add(key)
            kept.append(estimate)
    return kept


def _with_error_bar(plan: Plan, planner: Planner) -> Plan:
    """Record what the prediction was priced from (Plan.calibration) and the calibration's
    expected error (0 when uncalibrated); a plan on an uncalibrated profile says so in its notes."""
    if planner.overheads is None:
        if planner.cluster.profile is None:
            return replace(plan, calibration="datasheet")
        note = ("uncalibrated profile: the step time adds single kernels and collectives, without what whole steps "
                "add on this machine (on 4 gloo processes such prices ranked configurations poorly and picked "
                "~1.5x the best measured); `autopar profile --nproc N --out FILE` calibrates whole steps, "
                "then re-plan")
        if planner.cluster.profile.stale_calibrations:
            note += ("; its calibration was made by an earlier autopar, whose terms had other units, and was "
                     "left out")
        return replace(plan, calibration="uncalibrated", notes=plan.notes + (note,))
    calibration = planner.overheads.calibration
    note = (f"calibrated step time (profile calibration of {calibration.model} on {calibration.num_processes} "
            f"processes): expected error +-{100 * calibration.expected_error:.0f}% "
            f"(worst seen {100 * calibration.worst_error:.0f}%)")
    return replace(plan, predicted=replace(plan.predicted, expected_error=calibration.expected_error),
                   notes=plan.notes + (note,), calibration="calibrated")


def evaluate(model, example_inputs=None, cluster="cpu", *, global_batch: int, tp: int = 1, pp: int = 1,
             dp: int | None = None, microbatch_size: int = 1, schedule: str = "1f1b",
             virtual_stages: int | None = None, layers_per_virtual_stage: int | None = None,
             recompute: str = "none", zero_stage: int = 0, loss_fn=None, example_targets=None,
             precision: str = "bf16", verbose: bool = False, example_kwargs=None, ep: int = 1,
             cp: int = 1, offload: bool = False, sequence_parallel: bool = True,
             options: SearchOptions | None = None, moe_load_imbalance: float | None = None,
             fp8_recipe: str = "tensorwise", fp8_filter=None, etp: int | None = None,
             fp8_casts: str | None = None, pipeline_split: str = "balanced", tp_overlap: str | None = None) -> Plan:
    """Price one fully fixed configuration (no search); `ep` splits the experts of an MoE over
    groups of ep data-parallel ranks (`etp=1` with tp > 1: over ep ranks of the tp x dp grid, the
    experts unsplit by tp, MoE parallel folding: priced, not run by autopar's runtime yet), `cp` splits each sequence over cp ranks, `offload` is optimizer
    offload (ZeRO-3, pp = 1), `sequence_parallel=False` is tensor parallelism without sequence
    parallelism (Megatron-LM without --sequence-parallel), `pipeline_split` how the pipeline chunks
    are cut ("balanced": autopar's cut; "uniform" etc.: by count, as a framework cuts,
    solver/pipeline.py). `options` and `moe_load_imbalance` as for `plan` (`optimizer` says how
    AdamW runs), `tp_overlap` as for `planner_for`."""
    if moe_load_imbalance is not None:
        check_load_imbalance(moe_load_imbalance)
    check_async_needs_sp(tp_overlap, sequence_parallel)
    check_fixed_config(tp=tp, pp=pp, dp=dp, microbatch_size=microbatch_size, schedule=schedule,
                       virtual_stages=virtual_stages, layers_per_virtual_stage=layers_per_virtual_stage,
                       recompute=recompute, zero_stage=zero_stage, ep=ep, cp=cp, offload=offload,
                       sequence_parallel=sequence_parallel, etp=etp, pipeline_split=pipeline_split)
    check_model_arguments(model, example_inputs, loss_fn, example_targets)
    cluster = Cluster.from_spec(cluster)
    check_degrees(cluster, check_global_batch(global_batch), dp=dp, tp=tp, pp=pp,
                  microbatch_size=microbatch_size, schedule=schedule, cp=cp if cp > 1 else None)
    planner = planner_for(model, example_inputs, cluster, global_batch=global_batch, loss_fn=loss_fn,
                          example_targets=example_targets, precision=precision, verbose=verbose,
                          example_kwargs=example_kwargs, options=options, moe_load_imbalance=moe_load_imbalance,
                          fp8_recipe=fp8_recipe, fp8_filter=fp8_filter, fp8_casts=fp8_casts, tp_overlap=tp_overlap)
    config = fixed_config(planner, tp=tp, pp=pp, dp=dp, microbatch_size=microbatch_size, schedule=schedule,
                          virtual_stages=virtual_stages, layers_per_virtual_stage=layers_per_virtual_stage,
                          recompute=recompute, zero_stage=zero_stage, ep=ep, cp=cp, offload=offload,
                          sequence_parallel=sequence_parallel, etp=etp, pipeline_split=pipeline_split)
    return evaluate_with(planner, config)


def fixed_config(planner: Planner, *, tp: int, pp: int, dp: int | None, microbatch_size: int, schedule: str,
                 virtual_stages: int | None, layers_per_virtual_stage: int | None, recompute: str,
                 zero_stage: int, ep: int = 1, cp: int = 1, offload: bool = False,
                 sequence_parallel: bool = True, etp: int | None = None,
                 pipeline_split: str = "balanced") -> ParallelConfig:
    check_pipeline_depth(planner.graph, pp)
    devices = planner.cluster.num_devices
    if tp < 1 or pp < 1 or cp < 1 or devices % (tp * pp * cp):
        shown = f"tp x pp x cp = {tp} x {pp} x {cp}" if cp != 1 else f"tp x pp = {tp} x {pp}"
        raise ConfigError(f"{shown} must divide the cluster's {devices} devices")
    planner.check_cp(cp)
    dp = dp or devices // (tp * pp * cp)
    if microbatch_size < 1 or planner.global_batch % (dp * microbatch_size):
        raise ConfigError(f"global batch {planner.global_batch} is not divisible by dp x microbatch size = "
                          f"{dp} x {microbatch_size}")
    virtual = (virtual_stages or 2) if schedule == "zbv" else 1
    if schedule in ("interleaved", "zb1p"):
        constraints = Constraints(virtual_stages=virtual_stages, layers_per_virtual_stage=layers_per_virtual_stage)
        virtual = (planner.virtual_stages(pp, constraints) or [2 if schedule == "interleaved" else 1])[0]
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatch_size=microbatch_size,
                            num_microbatches=planner.global_batch // (dp * microbatch_size), schedule=schedule,
                            virtual_stages=virtual, recompute=recompute, zero_stage=zero_stage, ep=ep, cp=cp,
                            offload=offload, sequence_parallel=sequence_parallel, etp=etp,
                            pipeline_split=check_pipeline_split(pipeline_split))
    planner.check(config)
    return config


def evaluate_with(planner: Planner, config: ParallelConfig) -> Plan:
    estimate, sharding = planner.evaluate(config)
    notes = () if estimate.fits else (
        f"this configuration does not fit: {estimate.peak_memory_bytes / 2**30:.1f} GiB per device needed, "
        f"{planner.step_model.memory_budget_bytes / 2**30:.1f} GiB usable",)
    if config.folds_experts and runtime_blocker(config.cp, config.recompute):
        notes += (runtime_blocker(config.cp, config.recompute),)
    plan = make_plan(planner.graph, planner.cluster, global_batch=planner.global_batch, estimate=estimate,
                     sharding=sharding, memory_budget_bytes=planner.step_model.memory_budget_bytes, notes=notes,
                     precision=planner.precision, moe_load_imbalance=planner.moe_load_imbalance,
                     fp8=_fp8_of(planner, config), tp_overlap=tp_overlap_of(planner, config),
                     segments=planner.segment_costs(config.tp, config.microbatch_size, config.cp,
                                                    config.sequence_parallel, config.folds_experts),
                     strategies=planner.strategies(config.tp, config.microbatch_size, config.sequence_parallel,
                                                   config.folds_experts))
    return _with_error_bar(plan, planner)

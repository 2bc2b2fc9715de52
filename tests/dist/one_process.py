"""A parallel module against one process: the comparison the numerics cases of tests/dist share.

    reference = train_one_process(model, loss_fn, batches, learning_rate)
    run = train_parallel(module, batches, learning_rate, reference)
    run.losses, run.grad_errors      # per step; per parameter name (matched to the original model)

Both train with SGD on the same global batches ((inputs, targets) pairs; inputs a tuple of
positional inputs or a dict of keyword inputs) and record the first step's gradients: the
reference keeps them, the parallel run compares each of its parameters' (gathered with
`full_tensor()`) with the reference's of the same name. A test asserts on these records.

`parallelize_reusing_captures` is `autopar.parallelize` for a job that builds the same model
(same class, sizes, inputs) for many plans, one case after another: the planning capture and
the codegen capture are made once per key and reused (they are most of a tiny case's time).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Reference:
    """One process's run."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    """The first step's gradient of every parameter, by name."""
    model: torch.nn.Module
    """The trained copy (its weights after the last step)."""


@dataclass
class ParallelRun:
    """A parallel module's run, compared with the reference."""

    losses: list[float]
    grad_errors: dict[str, dict | None] = field(default_factory=dict)
    """Per parameter this rank holds: max_abs, norm (of the difference) and reference_norm;
    None when the parameter got no gradient."""


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def train_one_process(model, loss_fn, batches, learning_rate: float) -> Reference:
    """SGD on a copy of `model` (the model itself is left as it is, for the parallel run)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(batches):
        loss = loss_fn(call(model, inputs), targets)
        loss.backward()
        if step == 0:
            grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return Reference(losses=losses, grads=grads, model=model)


def train_parallel(module, batches, learning_rate: float, reference: Reference, *, first_step=None) -> ParallelRun:
    """SGD through `module.train_step`; `first_step` is a context manager the first step runs
    in (a collective counter, say)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=learning_rate)
    run = ParallelRun(losses=[])
    for step, (inputs, targets) in enumerate(batches):
        with first_step if step == 0 and first_step is not None else nullcontext():
            run.losses.append(module.train_step(inputs, targets).item())
        if step == 0:
            for name, param in module.named_model_parameters().items():
                run.grad_errors[name] = None if param.grad is None else grad_error(param.grad, reference.grads[name])
        optimizer.step()
        optimizer.zero_grad()
    return run


def grad_error(grad, reference: torch.Tensor) -> dict:
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    difference = full.detach().float() - reference.float()
    return dict(max_abs=difference.abs().max().item(), norm=difference.norm().item(),
                reference_norm=reference.norm().item())


# --- captures shared between the cases of one job -----------------------------------------------------

_PLANNERS: dict[Any, Any] = {}
_CAPTURES: dict[Any, tuple] = {}


def parallelize_reusing_captures(key, model, cluster: str, inputs: tuple, *, loss_fn, example_targets,
                                 constraints: dict, precision: str = "fp32"):
    """What `autopar.parallelize(model, cluster, inputs, loss_fn=..., example_targets=...,
    constraints=..., precision=...)` returns, planned (rank 0) and built from the captures of
    the first model this process saw under `key` (the same model: same class, sizes and
    inputs; its own parameters are bound into the reused program)."""
    import torch.distributed as dist

    from autopar.api import Constraints, plan_with, planner_for
    from autopar.capture import capture_program
    from autopar.codegen.parallelize import build_parallel_module
    from autopar.codegen.runtime import run_on_rank0

    def plan():
        planner_key = (key, cluster, dist.get_world_size())
        if planner_key not in _PLANNERS:
            _PLANNERS[planner_key] = planner_for(model, inputs, cluster, global_batch=int(inputs[0].shape[0]),
                                                 loss_fn=loss_fn, example_targets=example_targets,
                                                 precision=precision)
        return plan_with(_PLANNERS[planner_key], Constraints.from_value(constraints))

    chosen = run_on_rank0(plan)
    if key not in _CAPTURES:
        _CAPTURES[key] = capture_program(model, inputs, {}, allow_fallback=False)
    program, graph = _CAPTURES[key]
    live = {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}
    for name in list(program.state_dict):
        if name in live:
            program.state_dict[name] = live[name]
    return build_parallel_module(model, inputs, chosen, loss_fn, captured=(program, graph))

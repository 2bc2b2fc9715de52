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
the codegen capture are made once per key and reused (they are most of a tiny case's time); the
codegen capture is exported by rank 0 alone and loaded by the others (`load_program`).

`CaseTable` is the case list a numerics module parametrizes its test over:

    TABLE = CaseTable([case_param(Case("gpt", 2, dict(dp=2)), "gpt-dp2"), ...])
    CASES = TABLE.cases                           # {id: case}, for harness.case_outcome

    @TABLE.parametrize
    def test_x(case_name, case_outcome):
        case, results = TABLE.results(case_outcome, x_case, case_name)   # per rank, or the test fails
"""

from __future__ import annotations

import copy
import pickle
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
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
    partial_grads: list[str] = field(default_factory=list)
    """Parameters whose first-step gradient train_step left as pending sums (DTensor Partial)."""


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
    """SGD through `module.train_step`; `first_step` is a context manager the first training
    step runs in, `train_step` and the optimizer's step (a collective counter, say: what the
    optimizer would still reduce belongs to the step too). Plain SGD leaves the gradients as
    they are, so they are compared after its step."""
    optimizer = torch.optim.SGD(module.parameters(), lr=learning_rate)
    run = ParallelRun(losses=[])
    for step, (inputs, targets) in enumerate(batches):
        with first_step if step == 0 and first_step is not None else nullcontext():
            run.losses.append(module.train_step(inputs, targets).item())
            if step == 0:
                run.partial_grads = [name for name, param in module.named_model_parameters().items()
                                     if any(type(placement).__name__ == "Partial"
                                            for placement in getattr(param.grad, "placements", ()))]
            optimizer.step()
        if step == 0:
            for name, param in module.named_model_parameters().items():
                run.grad_errors[name] = None if param.grad is None else grad_error(param.grad, reference.grads[name])
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
                                 constraints: dict, precision: str = "fp32", plan=None, init_fn=None):
    """What `autopar.parallelize(model, cluster, inputs, loss_fn=..., example_targets=...,
    constraints=..., precision=..., plan=..., init_fn=...)` returns, planned (rank 0, unless
    `plan` is given) and built from the captures of the first model this process saw under
    `key` (the same model: same class, sizes, inputs and device, meta or not; its own
    parameters are bound into the reused program)."""
    import torch.distributed as dist

    from autopar.api import Constraints, plan_with, planner_for
    from autopar.capture import capture_program
    from autopar.codegen.parallelize import build_parallel_module
    from autopar.codegen.runtime import run_on_rank0

    def plan_on_rank0():
        planner_key = (key, cluster, dist.get_world_size())
        if planner_key not in _PLANNERS:
            _PLANNERS[planner_key] = planner_for(model, inputs, cluster, global_batch=int(inputs[0].shape[0]),
                                                 loss_fn=loss_fn, example_targets=example_targets,
                                                 precision=precision)
        return plan_with(_PLANNERS[planner_key], Constraints.from_value(constraints))

    chosen = plan if plan is not None else run_on_rank0(plan_on_rank0)
    if key not in _CAPTURES:
        _CAPTURES[key] = _codegen_capture(model, inputs)
    program, graph = _CAPTURES[key]
    live = {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}
    for name in list(program.state_dict):
        if name in live:
            program.state_dict[name] = live[name]
    return build_parallel_module(model, inputs, chosen, loss_fn, captured=(program, graph), init_fn=init_fn)


def _codegen_capture(model, inputs: tuple) -> tuple:
    """capture_program(model, inputs) on every rank, exported once: rank 0 captures and sends the
    saved program (torch.export.save) and its OpGraph; the other ranks load them, ~4x cheaper
    than exporting again. A program that does not serialise (or a one-process job) is
    captured by every rank itself. Every rank calls this for the same keys in the same order."""
    import io

    import torch.distributed as dist

    from autopar.capture import capture_program
    from autopar.codegen.runtime import run_on_rank0

    captured = None

    def capture_and_save():
        nonlocal captured
        captured = capture_program(model, inputs, {}, allow_fallback=False)
        if dist.get_world_size() == 1:
            return None
        buffer = io.BytesIO()
        try:
            torch.export.save(captured[0], buffer)
        except Exception:  # noqa: BLE001 - not every program serialises: the ranks then capture themselves
            return None
        return buffer.getvalue(), pickle.dumps(captured[1])

    saved = run_on_rank0(capture_and_save)
    if captured is not None:
        return captured
    if saved is None:
        return capture_program(model, inputs, {}, allow_fallback=False)
    return load_program(io.BytesIO(saved[0])), pickle.loads(saved[1])


class _CachedTypeHints:
    """The `typing` module as torch's export deserializer sees it, with `get_type_hints` memoized.

    The deserializer asks for the type hints of its schema dataclass again for every object it
    rebuilds (8,000 times for a 2-layer T5), and each answer re-evaluates the same annotations:
    40% of a load. The schema's classes do not change while a program loads, so one answer per
    (class, namespaces) is the same answer."""

    def __init__(self, typing_module) -> None:
        self.__dict__.update({name: value for name, value in vars(typing_module).items()
                              if name != "get_type_hints"})  # every other name as typing has it
        self._get_type_hints = typing_module.get_type_hints
        self._hints: dict = {}

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        if key not in self._hints:
            self._hints[key] = self._get_type_hints(obj, globalns, localns, include_extras)
        return self._hints[key]


_SERDE_TYPING: list = []
"""This process's _CachedTypeHints (made on first use; its answers serve every later load)."""


def load_program(source):
    """torch.export.load(source) (a path or a file object), with torch's serde module seeing
    `typing` through _CachedTypeHints: ~40% less CPU per load."""
    with _type_hints_cached_in_torch_serde():
        return torch.export.load(source)


class _type_hints_cached_in_torch_serde:
    """While loading: torch's serde module reads `typing` through _CachedTypeHints (a torch
    without that module attribute loads as it is)."""

    def __enter__(self):
        from torch._export.serde import serialize

        self._module = serialize
        self._typing = getattr(serialize, "typing", None)
        if self._typing is not None:
            if not _SERDE_TYPING:
                _SERDE_TYPING.append(_CachedTypeHints(self._typing))
            serialize.typing = _SERDE_TYPING[0]

    def __exit__(self, *exc_info):
        if self._typing is not None:
            self._module.typing = self._typing


# --- the case table of a numerics module ------------------------------------------------------------

def case_param(case, name: str, *marks) -> Any:
    """One row of a CaseTable: `case` (a frozen dataclass with `world_size` and optionally
    `known_error`, the message of a known bug's failure) under the test id `name`."""
    return pytest.param(case, id=name, marks=marks)


class CaseTable:
    """A module's cases, by test id, and what its one test does with them: parametrize over the
    ids (keeping each row's marks: a skip, an xfail) and fetch a case's per-rank results."""

    def __init__(self, params: list) -> None:
        self.params = list(params)
        self.cases = {param.id: param.values[0] for param in self.params}
        """{test id: case}: what harness.case_outcome runs, grouped by world size."""
        if len(self.cases) != len(self.params):
            raise ValueError(f"two cases share a test id in {[param.id for param in self.params]}")

    def parametrize(self, test):
        """The test, parametrized over `case_name` (every id of the table, with its marks)."""
        ids = [pytest.param(param.id, marks=param.marks, id=param.id) for param in self.params]
        return pytest.mark.parametrize("case_name", ids)(test)

    def results(self, case_outcome, case_fn, name: str) -> tuple[Any, list]:
        """(the case, what `case_fn(case)` returned on each rank, in rank order); the test fails
        with the failed rank's traceback instead, as harness.KnownBugError when it shows the
        case's `known_error`."""
        from harness import fail

        case = self.cases[name]
        outcome = case_outcome(case_fn, self.cases, name)
        if not outcome.ok:
            fail(outcome.error, getattr(case, "known_error", ""))
        return case, outcome.values

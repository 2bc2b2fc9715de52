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
import hashlib
import os
import pickle
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
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


# --- captures shared between the cases of one job, and between the jobs of one test process ---------

_PLANNERS: dict[Any, Any] = {}
_CAPTURES: dict[Any, tuple] = {}


def parallelize_reusing_captures(key, model, cluster: str, inputs: tuple | dict, *, loss_fn, example_targets,
                                 constraints: dict, precision: str = "fp32", plan=None, init_fn=None,
                                 fp8_recipe: str = "tensorwise", fp8_casts: str | None = None):
    """What `autopar.parallelize(model, cluster, inputs, loss_fn=..., example_targets=...,
    constraints=..., precision=..., plan=..., init_fn=...)` returns, planned (rank 0, unless
    `plan` is given) and built from the captures of the first model this process saw under
    `key` (the same model: same class, sizes, inputs and device, meta or not; its own
    parameters are bound into the reused program). An earlier job of the same test process that
    built the same model (same caller, key, class, parameter shapes, inputs, loss and precision)
    left its planning graph and codegen capture in the test process's shared folder
    (harness.SHARED_DIR_VARIABLE): rank 0 loads them instead of capturing again (each cluster is
    still planned). The 4-process job of a module mostly builds the models of its 2-process job.
    `inputs` is a tuple of positional inputs or a dict of keyword inputs, as parallelize takes them.
    Precision "fp8" takes `fp8_recipe` and `fp8_casts` as parallelize does."""
    import torch.distributed as dist

    from autopar.api import capture_for_planning, plan_with, planner_for, split_inputs
    from autopar.solver.constraints import Constraints
    from autopar.codegen.parallelize import build_parallel_module
    from autopar.codegen.runtime import run_on_rank0

    folder = _shared_folder(sys._getframe(1).f_globals.get("__name__", ""), key, model, inputs, loss_fn,
                            example_targets, precision)
    positional, keywords = split_inputs(inputs)
    global_batch = next(int(value.shape[0]) for value in (*positional, *keywords.values())
                        if isinstance(value, torch.Tensor) and value.dim() > 0)

    def planning_graph():
        stored = _read_stored(folder, "planning.pkl")
        if stored is not None:
            return pickle.loads(stored)
        graph = capture_for_planning(model, positional, loss_fn=loss_fn, example_targets=example_targets,
                                     example_kwargs=keywords, precision=precision)
        _store(folder, "planning.pkl", pickle.dumps(graph))
        return graph

    def plan_on_rank0():
        planner_key = (key, cluster, dist.get_world_size(), precision, fp8_recipe, fp8_casts)
        if planner_key not in _PLANNERS:
            _PLANNERS[planner_key] = planner_for(planning_graph(), positional, cluster, global_batch=global_batch,
                                                 loss_fn=loss_fn, example_targets=example_targets,
                                                 example_kwargs=keywords, precision=precision,
                                                 **({"fp8_recipe": fp8_recipe, "fp8_casts": fp8_casts}
                                                    if precision == "fp8" else {}))
        return plan_with(_PLANNERS[planner_key], Constraints.from_value(constraints))

    chosen = plan if plan is not None else run_on_rank0(plan_on_rank0)
    if (key, chosen.precision) not in _CAPTURES:
        _CAPTURES[key, chosen.precision] = _codegen_capture(model, positional, keywords, folder, chosen.precision)
    program, graph = _CAPTURES[key, chosen.precision]
    live = {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}
    for name in list(program.state_dict):
        if name in live:
            program.state_dict[name] = live[name]
    return build_parallel_module(model, positional, chosen, loss_fn, keywords, captured=(program, graph),
                                 init_fn=init_fn)


def _shared_folder(caller: str, key, model, inputs: tuple, loss_fn, example_targets, precision: str) -> Path | None:
    """This model's folder in the test process's shared folder (None without one): named by a hash
    of everything that makes two calls capture the same graphs."""
    from harness import SHARED_DIR_VARIABLE

    root = os.environ.get(SHARED_DIR_VARIABLE)
    if not root:
        return None

    def described(value) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
        if isinstance(value, (tuple, list)):
            return tuple(described(item) for item in value)
        if isinstance(value, dict):
            return tuple(sorted((name, described(item)) for name, item in value.items()))
        return repr(value)

    loss = getattr(loss_fn, "__module__", ""), getattr(loss_fn, "__qualname__", repr(loss_fn))
    identity = (caller, repr(key), type(model).__module__, type(model).__qualname__,
                described(dict(model.named_parameters(remove_duplicate=False))),
                described(dict(model.named_buffers(remove_duplicate=False))),
                described(inputs), described(example_targets), loss, precision)
    return Path(root) / hashlib.sha256(repr(identity).encode()).hexdigest()[:24]


def _read_stored(folder: Path | None, name: str) -> bytes | None:
    path = folder / name if folder is not None else None
    return path.read_bytes() if path is not None and path.exists() else None


def _store(folder: Path | None, name: str, data: bytes) -> None:
    """Written whole (renamed into place): a later job reads it complete or not at all."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f"{name}.{os.getpid()}.tmp"
    staging.write_bytes(data)
    staging.rename(folder / name)


def _codegen_capture(model, inputs: tuple, keywords: dict, folder: Path | None = None,
                     precision: str = "fp32") -> tuple:
    """capture_for_codegen(model, inputs, keywords, precision=precision) on every rank, exported
    once: rank 0 captures and sends the saved program (torch.export.save) and its OpGraph, or sends what an earlier job
    saved in `folder` (loading it itself); the other ranks load them, ~4x cheaper than exporting
    again. A program that does not serialise (or a one-process job) is captured by every rank
    itself. Every rank calls this for the same keys in the same order."""
    import io

    import torch.distributed as dist

    from autopar.capture.compute_dtype import capture_for_codegen
    from autopar.codegen.runtime import run_on_rank0

    captured = None

    def capture_and_save():
        nonlocal captured
        program, graph = _read_stored(folder, "program.pt2"), _read_stored(folder, "graph.pkl")
        if program is not None and graph is not None:
            captured = load_program(io.BytesIO(program)), pickle.loads(graph)
            return (program, graph) if dist.get_world_size() > 1 else None
        captured = capture_for_codegen(model, inputs, keywords, precision=precision)
        if dist.get_world_size() == 1 and folder is None:
            return None
        buffer = io.BytesIO()
        try:
            torch.export.save(captured[0], buffer)
        except Exception:  # noqa: BLE001 - not every program serialises: the ranks then capture themselves
            return None
        saved = buffer.getvalue(), pickle.dumps(captured[1])
        _store(folder, "graph.pkl", saved[1])
        _store(folder, "program.pt2", saved[0])
        return saved if dist.get_world_size() > 1 else None

    saved = run_on_rank0(capture_and_save)
    if captured is not None:
        return captured
    if saved is None:
        return capture_for_codegen(model, inputs, keywords, precision=precision)
    return load_program(io.BytesIO(saved[0])), pickle.loads(saved[1])


class _MemoizedModule:
    """A module as torch's export deserializer sees it, with one of its functions memoized.

    The deserializer calls `typing.get_type_hints` on its schema dataclasses again for every
    object it rebuilds (8,000 times for a 2-layer T5; each call re-evaluates the same
    annotations: 40% of a load), and `sympy.sympify` on the same symbolic-size strings for every
    node whose shape has the batch symbol in it (256 times for T5, ~25% of what was left). Both
    answers depend only on their arguments (the schema's classes; the string and the names it may
    use, the symbols of this load included), so one answer per arguments is the same answer.
    `key(args, kwargs)` says which arguments make a call the same (None: a call not memoized)."""

    def __init__(self, module, name: str, key) -> None:
        self.__dict__.update({attr: value for attr, value in vars(module).items() if attr != name})
        self._function, self._key, self._answers = getattr(module, name), key, {}
        self.__dict__[name] = self._memoized

    def _memoized(self, *args, **kwargs):
        key = self._key(args, kwargs)
        if key is None:
            return self._function(*args, **kwargs)
        if key not in self._answers:
            self._answers[key] = self._function(*args, **kwargs)
        return self._answers[key]


def _type_hints_key(args, kwargs) -> tuple:
    """get_type_hints(obj, globalns=None, localns=None, include_extras=False): the namespaces by id."""
    bound = dict(zip(("obj", "globalns", "localns", "include_extras"), args), **kwargs)
    return (bound["obj"], id(bound.get("globalns")), id(bound.get("localns")), bound.get("include_extras", False))


def _sympify_key(args, kwargs) -> tuple | None:
    """sympify(expr_str, locals=...) of a string: the string and every name it may use (the
    deserializer also passes sympy objects back through it: those calls are not memoized)."""
    if len(args) != 1 or set(kwargs) != {"locals"} or not isinstance(args[0], str):
        return None
    return args[0], frozenset(kwargs["locals"].items())


_SERDE_MODULES: dict = {}
"""This process's memoized modules, by the serde module's attribute name (made on first use; their
answers serve every later load)."""


def load_program(source):
    """torch.export.load(source) (a path or a file object), with torch's serde module seeing
    `typing` and `sympy` through _MemoizedModule: ~half the CPU per load."""
    with _memoized_in_torch_serde():
        return torch.export.load(source)


class _memoized_in_torch_serde:
    """While loading: torch's serde module reads `typing` and `sympy` through _MemoizedModule (a
    torch whose serde module lacks one of these attributes loads as it is)."""

    _MEMOS = (("typing", "get_type_hints", _type_hints_key), ("sympy", "sympify", _sympify_key))

    def __enter__(self):
        from torch._export.serde import serialize

        self._module, self._saved = serialize, {}
        for attribute, name, key in self._MEMOS:
            module = getattr(serialize, attribute, None)
            if module is None or not callable(getattr(module, name, None)):
                continue
            self._saved[attribute] = module
            if attribute not in _SERDE_MODULES:
                _SERDE_MODULES[attribute] = _MemoizedModule(module, name, key)
            setattr(serialize, attribute, _SERDE_MODULES[attribute])

    def __exit__(self, *exc_info):
        for attribute, module in self._saved.items():
            setattr(self._module, attribute, module)


# --- the case table of a numerics module ------------------------------------------------------------

@dataclass(frozen=True)
class BuiltinCase:
    """A case of a table of built-in specs trained by `train_builtin`."""
    model: str
    """A key of the test file's SPECS."""
    world_size: int
    constraints: dict = field(default_factory=dict)
    known_error: str = ""
    timeout_s: float = 150.0
    """Per case (harness.case_outcome): planning + capture + 3 steps on 2 shared cores."""


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


def train_builtin(spec: str, world_size: int, constraints: dict, *, global_batch: int, seq: int, vocab: int,
                  num_steps: int, learning_rate: float):
    """(the parallel module, its run, one process's run) of built-in model `spec` trained
    `num_steps` SGD steps on random token batches under `constraints` on the tiny cluster of
    `world_size` devices (harness.tiny_model_cluster); its captures are reused under the spec."""
    from autopar.models import build_model
    from harness import tiny_model_cluster

    bundle = build_model(spec, device="cpu", seed=0, batch_size=global_batch)
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, vocab, (global_batch, seq), generator=generator),),
                torch.randint(0, vocab, (global_batch, seq), generator=generator)) for _ in range(num_steps)]
    reference = train_one_process(bundle.model, bundle.loss_fn, batches, learning_rate)
    (inputs, targets), *_ = batches
    module = parallelize_reusing_captures(spec, bundle.model, tiny_model_cluster(world_size), inputs,
                                          loss_fn=bundle.loss_fn, example_targets=targets, constraints=constraints)
    return module, train_parallel(module, batches, learning_rate, reference), reference

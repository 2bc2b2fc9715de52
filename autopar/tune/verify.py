"""`autopar verify MODEL`: is autopar's sharding of this model exact? Each plan kind against one process.

    report = verify("llama3-8b", num_processes=4, steps=3)    # a tiny llama, every kind of 2 and 4 processes
    print(format_table(report)); report.ok                      # every cell matches or is n/a

A tiny copy of the model (`tiny_spec`: a built-in spec with its sizes capped at the family's tiny
defaults, dropout off; a `file.py:factory` as the factory builds it, its `nn.Dropout`s off) is
trained for `steps` plain SGD steps in fp32, on fixed seeds for the weights, the batches and the
random ops' draws (DRAW_SEED):
once in this process with plain PyTorch (the reference, as tests/dist/one_process.py does), and
under each plan kind (`KINDS`: a constraints dict forced on the planner, cluster cpu:procs=N) on
spawned gloo processes. The kinds of one world size run in one job: rank 0 plans every kind from
one capture, every rank captures the program once and builds each kind's module from it. A kind
the planner refuses for this model (cp without a splittable sequence, ep without expert
matmuls, pp with one layer) is "n/a" with the planner's reason; a kind that fails while building
or training is an error; the others compare their losses with the reference's (TOLERANCE).
A model with random ops left on (a router that samples experts): tp draws what one process
draws (codegen/random_ops.py), but dp replicas, cp ranks, pipeline stages and microbatches draw
for their own share; such a kind whose losses differ is "random" (random ops: drawn per replica),
not compared and not a mismatch. A
job whose processes die or hang (one rank failed inside a collective) is stopped after
`timeout_s`, and its kinds show the first failed rank's error.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from autopar.errors import AutoparError, ConfigError, ModelSpecError

TOLERANCE = 1e-4
"""Largest |loss - one process's loss| over the steps that counts as a match (fp32)."""
LEARNING_RATE = 0.1
SEED = 0
"""The model's weights; step k's batch is drawn under SEED + 1 + k."""
DRAW_SEED = 1000
"""The generator state the reference and every kind train from (the model's random ops)."""


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One plan kind: a mesh forced on the planner."""

    name: str  # e.g. "tp" or "pp x tp"
    world_size: int  # processes it runs on
    constraints: dict  # for the planner (solver/constraints.py)


KINDS: tuple[Kind, ...] = (
    Kind(name="dp", world_size=2, constraints=dict(dp=2, tp=1, pp=1, zero_stage=0)),
    Kind(name="tp", world_size=2, constraints=dict(dp=1, tp=2, pp=1)),
    Kind(name="pp", world_size=2, constraints=dict(dp=1, tp=1, pp=2, microbatch_size=1, schedule="1f1b")),
    Kind(name="cp", world_size=2, constraints=dict(dp=1, tp=1, pp=1, cp=2)),
    Kind(name="ep", world_size=2, constraints=dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0)),
    Kind(name="zero3", world_size=2, constraints=dict(dp=2, tp=1, pp=1, zero_stage=3)),
    Kind(name="recompute", world_size=2, constraints=dict(dp=2, tp=1, pp=1, zero_stage=0, recompute="full")),
    Kind(name="interleaved", world_size=2, constraints=dict(dp=1, tp=1, pp=2, microbatch_size=1,
                                                            schedule="interleaved", virtual_stages=2)),
    Kind(name="ep x zero3", world_size=2, constraints=dict(dp=2, tp=1, pp=1, ep=2, zero_stage=3)),
    Kind(name="dp x tp", world_size=4, constraints=dict(dp=2, tp=2, pp=1, zero_stage=0)),
    Kind(name="pp x tp", world_size=4, constraints=dict(dp=1, tp=2, pp=2, microbatch_size=1, schedule="1f1b")),
    Kind(name="pp x dp", world_size=4, constraints=dict(dp=2, tp=1, pp=2, microbatch_size=1, schedule="1f1b",
                                                         zero_stage=0)),
    Kind(name="dp x cp", world_size=4, constraints=dict(dp=2, tp=1, pp=1, cp=2, zero_stage=0)),
    Kind(name="ep x tp", world_size=4, constraints=dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0)),
    Kind(name="ep x pp", world_size=4, constraints=dict(dp=2, tp=1, pp=2, ep=2, microbatch_size=1, schedule="1f1b",
                                                        zero_stage=0)),
    Kind(name="ep x cp", world_size=4, constraints=dict(dp=2, tp=1, pp=1, cp=2, ep=2, zero_stage=0)),
)
NUM_PROCESSES = (2, 4)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One kind's outcome."""

    kind: str
    result: str  # "match", "MISMATCH", "random" (random ops drawn per replica: not compared), "n/a" or "error"
    mesh: str = ""  # e.g. "dp=1 tp=2 pp=1" (empty when not planned)
    max_deviation: float | None = None  # largest |loss - reference| over the steps
    losses: list[float] = field(default_factory=list)
    sharded_params: int = 0  # parameters the plan splits (tensor- or expert-parallel); pp and dp split none
    reason: str = ""  # why n/a, or the error


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Every kind's cell, and what they were compared with."""

    model: str  # the spec of the copy that ran
    steps: int
    reference_losses: list[float]
    cells: list[Cell]

    @property
    def ok(self) -> bool:
        """Every cell matches, is n/a, or draws its random ops per replica."""
        return all(cell.result in ("match", "random", "n/a") for cell in self.cells)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok, "tolerance": TOLERANCE}


def select_kinds(num_processes: int, names: list[str] | None = None) -> list[Kind]:
    """The kinds to run on `num_processes` (2: the single axes; 4: also their 2 x 2 mixes), or
    the named ones; raises ConfigError for an unknown name or one that needs more processes."""
    if num_processes not in NUM_PROCESSES:
        raise ConfigError(f"verify runs on 2 or 4 processes (4 adds the 2 x 2 mixes), got {num_processes}")
    if not names:
        return [kind for kind in KINDS if kind.world_size <= num_processes]
    by_name = {kind.name.replace(" ", ""): kind for kind in KINDS}
    chosen = []
    for name in names:
        kind = by_name.get(name.replace(" ", "").lower())
        if kind is None:
            raise ConfigError(f"unknown plan kind '{name}'; the kinds are {', '.join(by_name)}")
        if kind.world_size > num_processes:
            raise ConfigError(f"the kind '{kind.name}' runs on {kind.world_size} processes: give --nproc "
                              f"{kind.world_size}")
        if kind not in chosen:
            chosen.append(kind)
    return chosen


def tiny_spec(spec: str) -> str:
    """A built-in spec shrunk: every integer field capped at the family's default (the tiny-<family>
    sizes), a field whose default is None (ffn_hidden: 4 x hidden) back to None, dropout 0; the
    user's other keys (attention kind, norm, rope base...) kept. A file spec is returned as is."""
    from autopar.models import resolve_spec
    from autopar.models.spec import format_overrides

    resolved = resolve_spec(spec)
    if resolved.family is None:
        return resolved.name
    config, defaults = resolved.config, resolved.family.config_cls()
    sizes, rest = {}, {}
    for item in dataclasses.fields(config):
        default, value = getattr(defaults, item.name), getattr(config, item.name)
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, int):
            sizes[item.name] = min(value, default)
        elif item.default is None and isinstance(value, int):
            sizes[item.name] = None
        elif item.name == "dropout":
            rest[item.name] = 0.0
    try:
        shrunk = dataclasses.replace(config, **sizes, **rest)
    except ModelSpecError:  # the capped sizes break a rule (heads must divide hidden): the tiny sizes
        shrunk = dataclasses.replace(config, **{name: getattr(defaults, name) for name in sizes}, **rest)
    return f"{resolved.family.name}:{format_overrides(shrunk)}"


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """The tiny copy and its batches, the same in every process (fixed seeds)."""

    model: object
    loss_fn: object
    batches: list  # (inputs, targets) per step; inputs a tuple of positional inputs


def _setup(spec: str, steps: int, batch_size: int) -> _Setup:
    import torch

    from autopar.models import build_model

    bundle = build_model(spec, batch_size=batch_size, device="cpu", seed=SEED)
    if bundle.loss_fn is None:
        raise ConfigError(f"verify trains the model and compares losses: the factory of '{spec}' returns no loss_fn; "
                          "return (model, example_inputs, loss_fn, example_targets)")
    for module in bundle.model.modules():  # a dropout mask is drawn per rank: not comparable
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if bundle.config is None:  # a factory's one example batch, every step
        batches = [(tuple(bundle.example_inputs), bundle.example_targets)] * steps
    else:
        from autopar.models import FAMILIES

        family = FAMILIES[type(bundle.config).family].module
        batches = []
        for step in range(steps):
            torch.manual_seed(SEED + 1 + step)
            batches.append((family.example_inputs(bundle.config, batch_size, "cpu"),
                            family.example_targets(bundle.config, batch_size, "cpu")))
    return _Setup(model=bundle.model, loss_fn=bundle.loss_fn, batches=batches)


def reference_losses(setup: _Setup) -> list[float]:
    """Plain PyTorch in this process: SGD on a copy of the model (as tests/dist/one_process.py)."""
    import torch

    model = copy.deepcopy(setup.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    torch.manual_seed(DRAW_SEED)
    for inputs, targets in setup.batches:
        loss = setup.loss_fn(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


COMPUTE_BOUND_CLUSTER = """\
# autopar verify: a DGX A100 whose GPUs compute 10^4 times slower, so that the planner shards a
# tiny model as it shards a large one on real GPUs (on real figures a tiny model is all latency
# and every op stays replicated: nothing would be verified).
preset = "dgx-a100-80g"
gpus_per_node = {num_devices}
[device]
fp32_tflops = 0.01
tf32_tflops = 0.01
bf16_tflops = 0.01
"""


@contextlib.contextmanager
def compute_bound_cluster(num_devices: int):
    """The path of a cluster file on which a tiny model is compute-bound, in a private temporary
    folder (removed after); only rank 0's planner reads it, the processes run on this machine's
    CPUs."""
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as folder:
        path = Path(folder) / f"compute-bound-{num_devices}.toml"
        path.write_text(COMPUTE_BOUND_CLUSTER.format(num_devices=num_devices))
        yield str(path)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def run_kinds(spec: str, steps: int, batch_size: int, kinds: list[Kind]) -> dict[str, dict]:
    """Every rank of a gloo job of kinds[i].world_size processes: rank 0 plans each kind (one
    capture), every rank builds each planned kind's module from one capture of the program and
    trains it; returns per kind its mesh, losses, sharded parameter count, or why it did not run."""
    import torch

    from autopar.capture.compute_dtype import capture_for_codegen
    from autopar.codegen.parallelize import build_parallel_module
    from autopar.codegen.runtime import run_on_rank0
    from autopar.plans.planning import plan_with, planner_for
    from autopar.solver.constraints import Constraints

    setup = _setup(spec, steps, batch_size)
    inputs, targets = setup.batches[0]
    world = kinds[0].world_size

    def plan_all() -> dict:
        with compute_bound_cluster(world) as cluster:
            planner = planner_for(setup.model, inputs, cluster, global_batch=int(inputs[0].shape[0]),
                                  loss_fn=setup.loss_fn, example_targets=targets, precision="fp32")
        plans = {}
        for kind in kinds:
            try:
                plans[kind.name] = plan_with(planner, Constraints.from_value(kind.constraints))
            except AutoparError as error:
                plans[kind.name] = " ".join(str(error).split())
        return plans

    plans = run_on_rank0(plan_all)
    results = {}
    captured = None
    for kind in kinds:
        plan = plans[kind.name]
        if isinstance(plan, str):
            results[kind.name] = dict(result="n/a", reason=plan)
            continue
        axes = {**plan.mesh, "ep": plan.ep}
        mesh = " ".join(f"{axis}={size}" for axis, size in axes.items() if size > 1) or "1"
        sharded = len({name for name, placement in plan.param_placements.items() if placement != "R"}
                      | set(plan.ep_params))
        try:
            if captured is None:
                captured = capture_for_codegen(setup.model, inputs, {}, precision=plan.precision)
            module = build_parallel_module(setup.model, inputs, plan, setup.loss_fn, {}, captured=captured)
            optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
            losses = []
            torch.manual_seed(DRAW_SEED)
            for step_inputs, step_targets in setup.batches:
                losses.append(module.train_step(step_inputs, step_targets).item())
                optimizer.step()
                optimizer.zero_grad()
        except Exception as error:  # noqa: BLE001 - the cell shows it; a rank stuck in a collective times out
            results[kind.name] = dict(result="error", mesh=mesh, sharded_params=sharded, reason=_short(error))
            continue
        results[kind.name] = dict(mesh=mesh, sharded_params=sharded, losses=losses,
                                  random_ops=sorted(set(module.random_ops)), draws=per_replica_draws(plan))
    return results


def per_replica_draws(plan) -> str:
    """Why a run of `plan` draws a model's random numbers otherwise than one process does ("" when
    it draws them as one process, which tp alone does): the ranks or microbatches that draw for
    their own share (codegen/random_ops.py)."""
    from autopar.codegen.expert_folding import folds_experts

    shares = [f"{axis}={plan.mesh.get(axis, 1)} {what}" for axis, what in
              (("dp", "replicas"), ("cp", "sequence shares"), ("pp", "stages")) if plan.mesh.get(axis, 1) > 1]
    if plan.num_microbatches > 1:
        shares.append(f"{plan.num_microbatches} microbatches")
    if folds_experts(plan):
        shares.append("MoE layers folded on each tp rank's tokens")
    return ", ".join(shares)


def compare(kind: str, outcome: dict, reference: list[float]) -> Cell:
    """A job's outcome for one kind as a cell: n/a and errors as they are, losses against the reference."""
    if "losses" not in outcome:
        return Cell(kind=kind, result=outcome["result"], mesh=outcome.get("mesh", ""),
                    sharded_params=outcome.get("sharded_params", 0), reason=outcome["reason"])
    losses = outcome["losses"]
    deviation = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    if deviation > TOLERANCE and outcome.get("random_ops") and outcome.get("draws"):
        return Cell(kind=kind, result="random", mesh=outcome["mesh"], max_deviation=deviation, losses=losses,
                    sharded_params=outcome["sharded_params"],
                    reason=f"{outcome['draws']} draw for their own share: {', '.join(outcome['random_ops'])}")
    return Cell(kind=kind, result="match" if deviation <= TOLERANCE else "MISMATCH", mesh=outcome["mesh"],
                max_deviation=deviation, losses=losses, sharded_params=outcome["sharded_params"])


def verify(model: str, *, num_processes: int = 4, steps: int = 3, kinds: list[str] | None = None,
           timeout_s: float = 300.0, progress=None) -> VerifyReport:
    """Train a tiny copy of `model` (a built-in spec or file.py:factory) under each plan kind on
    spawned gloo processes and compare its losses with one process's; see the module docstring."""
    from autopar.tune.launch import spawn

    if not isinstance(model, str) or not model:
        raise ConfigError(f"verify takes a model spec (a built-in name or file.py:factory), got {model!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise ConfigError(f"steps must be an integer from 1 to 100, got {steps!r}")
    chosen = select_kinds(num_processes, kinds)
    spec = tiny_spec(model)
    batch_size = 2 * num_processes
    setup = _setup(spec, steps, batch_size)
    reference = reference_losses(setup)
    outcomes: dict[str, dict] = {}
    for world in sorted({kind.world_size for kind in chosen}):
        group = [kind for kind in chosen if kind.world_size == world]
        if progress is not None:
            progress(f"{', '.join(kind.name for kind in group)} on {world} processes")
        try:
            outcomes.update(spawn(run_kinds, num_processes=world, args=(spec, steps, batch_size, group),
                                  timeout_s=timeout_s).value)
        except ConfigError as error:  # a process died or hung: every kind of the job shows why
            reason = " ".join(str(error).split())[-300:]
            outcomes.update({kind.name: dict(result="error", reason=reason) for kind in group})
    cells = [compare(kind.name, outcomes[kind.name], reference) for kind in chosen]
    return VerifyReport(model=spec, steps=steps, reference_losses=reference, cells=cells)


def format_table(report: VerifyReport) -> str:
    """The cells as a text table and a last line saying whether the sharding is exact."""
    rows = [("kind", "mesh", "sharded params", "max |loss - 1 process|", "result")]
    for cell in report.cells:
        deviation = "" if cell.max_deviation is None else f"{cell.max_deviation:.2e}"
        result = {"n/a": f"n/a: {cell.reason}", "error": f"error: {cell.reason}",
                  "random": f"random ops: drawn per replica ({cell.reason})"}.get(cell.result, cell.result)
        rows.append((cell.kind, cell.mesh, str(cell.sharded_params) if cell.mesh else "", deviation, result))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    lines = [" | ".join(value.ljust(width) for value, width in zip(row[:4], widths)) + " | " + row[4]
             for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths) + "-+-" + "-" * 6)
    counts = {result: sum(cell.result == result for cell in report.cells)
              for result in ("match", "MISMATCH", "random", "error", "n/a")}
    summary = ", ".join(f"{number} {result}" for result, number in counts.items() if number)
    verdict = "NOT exact"
    if report.ok:
        verdict = "exact: every kind that runs matches one process" if not counts["random"] else \
            "exact where comparable: the other kinds that run match one process"
    lines.append(f"{report.model}, {report.steps} SGD steps, fp32, tolerance {TOLERANCE:g}: {summary}; {verdict}")
    return "\n".join(lines)

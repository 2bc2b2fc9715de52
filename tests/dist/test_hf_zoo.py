"""Hugging Face models as users have them, under every plan kind, match one process.

Every architecture of hf_zoo.py (default attention, keyword inputs, a loss reading
`out.logits`) is trained for NUM_STEPS SGD steps in fp32 under dp2, tp2, pp2, dp2 x tp2 and
pp2 x tp2 (interleaved), with plans forced by constraints, and its losses must match one
process within TOLERANCE.

Where the time goes (the 32 architectures that ran all five meshes, 2 shared cores, 2026-12-05:
~370 CPU-s of ranks): the 2-process job ~130 (two exports per architecture ~65, planning ~17,
loading the saved capture ~9, training steps ~32), the 4-process job ~230 (steps ~140, ~80 of
them pp2 x tp2's; building the modules ~55, mostly the MoE layers dp2 x tp2 folds, which every
rank exports again at its share of the tokens; loading ~36). Linear attention costs most: Qwen3.5
alone ~60 CPU-s, for the gated delta rule's 63-step loop over each chunk's rows (thousands of ops
to export, plan, and propagate DTensor shardings for on the first step). Starting processes
and importing transformers cost little beside these. So the meshes of one world size run in one
job of gloo processes (the harness's `run_cases`), and each architecture is exported twice in all (once for planning,
once for codegen): the first job's rank 0 captures for planning and plans that job's meshes
while its last rank captures for codegen and runs one process; the planning graph then goes
to the last rank, which plans the 4-process meshes, and the codegen capture is saved
(torch.export.save) for the other ranks and for the 4-process job, which loads plans, losses
and capture from the run's shared folder (`_shared_dir`) instead of capturing again.

`python tests/dist/test_hf_zoo.py [ARCH ...]` runs the zoo (or some architectures) and prints the
README's supported-model table, each cell's deviation or failure on stderr; `--write-readme`
runs all of it and writes the table into README.md.

AUTOPAR_ZOO_MESHES=tp2,pp2 runs only those cells, in that order (a hand run of hf_zoo.HELD_OUT).

`make test` runs every architecture of hf_zoo.TESTED, those of hf_zoo.IN_SUITE_TWO_PROCESSES
under the 2-process meshes only; AUTOPAR_ZOO=GPT-2,Llama (names of hf_zoo.py) runs every mesh of
some.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_zoo  # noqa: E402
from harness import case_outcome, tiny_model_cluster  # noqa: E402,F401 (a fixture)
from one_process import load_program  # noqa: E402

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 4
NUM_STEPS = 3
LEARNING_RATE = 0.1
TOLERANCE = 1e-4
DRAW_SEED = 2
"""The generator state every rank (and the one-process reference) trains from: a model's random
ops (Phi-MoE's expert sampling) then draw what one process draws under tp (codegen/random_ops.py)."""

MESHES = {
    "dp2": (2, dict(dp=2, tp=1, pp=1, zero_stage=0)),
    "tp2": (2, dict(dp=1, tp=2, pp=1)),
    "pp2": (2, dict(dp=1, tp=1, pp=2, microbatch_size=1, schedule="1f1b")),
    "dp2xtp2": (4, dict(dp=2, tp=2, pp=1, zero_stage=0)),
    "pp2xtp2": (4, dict(dp=1, tp=2, pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2,
                        zero_stage=0)),
}


CHOSEN_MESHES = [mesh for mesh in os.environ.get("AUTOPAR_ZOO_MESHES", "").split(",") if mesh] or list(MESHES)
"""The meshes run, in this order (AUTOPAR_ZOO_MESHES=tp2,pp2: a hand run of some cells; default: all)."""
if set(CHOSEN_MESHES) - set(MESHES):
    raise ValueError(f"AUTOPAR_ZOO_MESHES names unknown meshes {sorted(set(CHOSEN_MESHES) - set(MESHES))}")


@dataclass(frozen=True)
class ZooCase:
    """One architecture under every mesh of one world size (one capture serves them all)."""

    arch: str
    world_size: int
    shared_dir: str = ""
    """Folder where the first job of an architecture leaves the plans of the other world size's
    meshes, one process's losses and the codegen capture, which a later job reads instead of
    capturing and planning again."""
    timeout_s: float = 180.0
    """How long the case may run (capture, planning and every mesh of this world size)."""
    later_sizes: tuple[int, ...] = (4,)
    """The world sizes of the jobs that run this architecture after this one: this job plans their
    meshes (none when their cells are not run)."""

    @property
    def meshes(self) -> list[str]:
        return [mesh for mesh in CHOSEN_MESHES if MESHES[mesh][0] == self.world_size]


def _reference(model, loss_fn, batches) -> list[float]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    torch.manual_seed(DRAW_SEED)
    for inputs, targets in batches:
        loss = loss_fn(model(**inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _planner(graph_or_model, batches, loss_fn, world_size: int):
    """A Planner for `world_size` processes; the model is captured for planning (a meta replica,
    keyword inputs and the loss as a user passes them to `autopar.plan`) unless a graph is given."""
    from autopar.api import planner_for

    example_inputs, example_targets = batches[0]
    return planner_for(graph_or_model, example_inputs, tiny_model_cluster(world_size), global_batch=GLOBAL_BATCH,
                       loss_fn=loss_fn, example_targets=example_targets, precision="fp32")


def _plans(planner, world_size: int) -> dict:
    from autopar.api import plan_with
    from autopar.solver.constraints import Constraints

    return {mesh: plan_with(planner, Constraints.from_value(constraints))
            for mesh, (size, constraints) in MESHES.items() if size == world_size}


def _folder(case: ZooCase) -> Path | None:
    return Path(case.shared_dir) / case.arch if case.shared_dir else None


def _stored_plans(case: ZooCase) -> tuple[dict, list[float]] | None:
    """This case's plans and one-process losses, if an earlier job left them."""
    from autopar.plans.plan import Plan

    folder = _folder(case)
    if folder is None or not all((folder / f"{mesh}.json").exists() for mesh in case.meshes) \
            or not (folder / "reference.json").exists():
        return None
    return ({mesh: Plan.load(folder / f"{mesh}.json") for mesh in case.meshes},
            json.loads((folder / "reference.json").read_text()))


def _write(path: Path, data: bytes) -> None:
    path.with_suffix(".tmp").write_bytes(data)
    path.with_suffix(".tmp").rename(path)


def _store_plans(case: ZooCase, plans: dict, reference: list[float] | None = None) -> None:
    folder = _folder(case)
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for mesh, plan in plans.items():
        _write(folder / f"{mesh}.json", plan.to_json().encode())
    if reference is not None:
        _write(folder / "reference.json", json.dumps(reference).encode())


def _capture_and_store(model, inputs, case: ZooCase):
    """capture_program for codegen, saved (torch.export.save, and the OpGraph) for the other
    ranks and the later job: export is most of a tiny model's time in this test."""
    from autopar.capture.export import capture_program

    program, graph = capture_program(model, (), inputs, allow_fallback=False)
    folder = _folder(case)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            import io

            buffer = io.BytesIO()
            torch.export.save(program, buffer)
        except Exception:  # noqa: BLE001 - not every program serialises: the ranks then capture themselves
            return program, graph
        _write(folder / "program.pt2", buffer.getvalue())
        _write(folder / "graph.pkl", pickle.dumps(graph))
    return program, graph


def _stored_capture(model, case: ZooCase):
    """The saved codegen capture bound to this rank's model (its own Parameter objects, so that
    tied weights are one object again, as in the program export returns), or None."""
    folder = _folder(case)
    if folder is None or not (folder / "program.pt2").exists():
        return None
    try:
        program = load_program(folder / "program.pt2")
    except Exception:  # noqa: BLE001 - torch saves some programs it cannot load (Phi-MoE's in-place uniform_)
        return None
    live = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    for name in list(program.state_dict):
        if name in live:
            program.state_dict[name] = live[name]
    return program, pickle.loads((folder / "graph.pkl").read_bytes())


def _prepare(case: ZooCase, model, batches, loss_fn) -> tuple[dict, list[float], tuple]:
    """(this world size's plans, one process's losses, the codegen capture) on every rank.

    The first job of an architecture: rank 0 captures for planning and plans this world size's
    meshes while the last rank captures for codegen (and saves it) and runs one process; then the
    last rank gets the planning graph and plans the later jobs' meshes (stored for them) while the
    other ranks load the saved codegen capture. A later job loads it all. (Rank 0 plans before it
    sends the graph: the ranks then wait on each other once, not twice.)"""
    import torch.distributed as dist

    from autopar.capture.export import capture_program
    from autopar.codegen.runtime import broadcast_object

    stored = _stored_plans(case)
    if stored is not None:
        captured = _stored_capture(model, case)
        return (*stored, captured or capture_program(model, (), batches[0][0], allow_fallback=False))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    graph = captured = reference = plans = None
    if rank == 0:
        planner = _planner(model, batches, loss_fn, case.world_size)
        graph, plans = planner.graph, _plans(planner, case.world_size)
    if rank == last:
        captured = _capture_and_store(model, batches[0][0], case)
        reference = _reference(model, loss_fn, batches)
    if case.later_sizes:
        graph = broadcast_object(graph)
    reference = broadcast_object(reference, src=last)
    if rank == last:
        for size in case.later_sizes:
            _store_plans(case, _plans(_planner(graph, batches, loss_fn, size), size))
    if rank != last:
        captured = _stored_capture(model, case) or capture_program(model, (), batches[0][0], allow_fallback=False)
    plans = broadcast_object(plans)
    if rank == 0:
        _store_plans(case, {}, reference)
    return plans, reference, captured


def zoo_case(case: ZooCase) -> dict:
    """Per mesh: this rank's losses over NUM_STEPS steps, one process's, and what the plan shards.

    Rank 0 plans and every rank builds each mesh's module from one codegen capture of the
    model, as `autopar.parallelize` does; the capture for planning, the plans and the codegen
    capture are made once per architecture and shared between ranks and jobs (`_prepare`)."""
    from autopar.codegen.parallelize import build_parallel_module

    arch = hf_zoo.BY_NAME[case.arch]
    torch.manual_seed(0)
    model = arch.build()
    generator = torch.Generator().manual_seed(1)
    batches = [hf_zoo.batch(arch, GLOBAL_BATCH, generator) for _ in range(NUM_STEPS)]
    loss_fn = hf_zoo.loss_for(arch)
    plans, reference, captured = _prepare(case, model, batches, loss_fn)
    results = {}
    for mesh in case.meshes:
        try:
            module = build_parallel_module(model, (), plans[mesh], loss_fn, batches[0][0], captured=captured)
            optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
            losses = []
            torch.manual_seed(DRAW_SEED)
            for inputs, targets in batches:
                losses.append(module.train_step(inputs, targets).item())
                optimizer.step()
                optimizer.zero_grad()
        except Exception as error:
            raise RuntimeError(f"{case.arch} under {mesh} failed: {type(error).__name__}: {error}") from error
        plan = module.plan
        results[mesh] = dict(losses=losses, reference=reference, mesh=plan.mesh, schedule=plan.schedule,
                             random_ops=module.random_ops, microbatches=plan.num_microbatches,
                             sharded=sorted(name for name, placement in plan.param_placements.items()
                                            if placement != "R"))
    return results


NAMED = [name for name in os.environ.get("AUTOPAR_ZOO", "").split(",") if name and name != "all"]
SELECTED = NAMED or [arch.name for arch in hf_zoo.TESTED]
"""The architectures whose tests are collected (AUTOPAR_ZOO=a,b,...; default: all of them)."""
if set(SELECTED) - set(hf_zoo.BY_NAME):
    raise ValueError(f"AUTOPAR_ZOO names unknown architectures {sorted(set(SELECTED) - set(hf_zoo.BY_NAME))}; "
                     f"known: {', '.join(hf_zoo.BY_NAME)}")

_SHARED_DIR_VARIABLE = "AUTOPAR_ZOO_SHARED_DIR"


def _shared_dir() -> str:
    """This run's folder for what the 2-process job leaves the 4-process job, made (and removed
    at exit) by the process that collects the tests; the workers, which import this module
    again, inherit its name."""
    folder = os.environ.get(_SHARED_DIR_VARIABLE)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="autopar-zoo-")
        os.environ[_SHARED_DIR_VARIABLE] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _sizes(name: str) -> tuple[int, ...]:
    """The world sizes whose cells the zoo test runs for an architecture: the 2-process ones only
    for hf_zoo.IN_SUITE_TWO_PROCESSES unless AUTOPAR_ZOO names it."""
    if name not in SELECTED:
        return ()
    return (2,) if name in hf_zoo.IN_SUITE_TWO_PROCESSES and name not in NAMED else (2, 4)


CASES = {f"{arch.name}-{size}": ZooCase(arch.name, size, _shared_dir(),
                                        later_sizes=tuple(later for later in _sizes(arch.name) if later > size))
         for size in (2, 4) for arch in hf_zoo.ARCHITECTURES + hf_zoo.RECENT + hf_zoo.HELD_OUT}
TESTS = [(f"{arch.name}-{size}", mesh) for mesh in CHOSEN_MESHES for size in (MESHES[mesh][0],)
         for arch in hf_zoo.ARCHITECTURES + hf_zoo.RECENT if size in _sizes(arch.name)]


def check(outcome, mesh: str) -> None:
    if not outcome.ok:
        raise AssertionError(outcome.error)
    results = [values[mesh] for values in outcome.values]
    _, constraints = MESHES[mesh]
    for axis in ("dp", "tp", "pp"):
        assert results[0]["mesh"][axis] == constraints[axis], results[0]["mesh"]
    if constraints["tp"] > 1:
        assert results[0]["sharded"], "the plan shards no parameter: the tp case tests nothing"
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(result["reference"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}: {result['losses']} vs one process {result['reference']}"


@pytest.mark.parametrize("case_name,mesh", TESTS, ids=[f"{name.rsplit('-', 1)[0]}-{mesh}" for name, mesh in TESTS])
def test_matches_one_process(case_name, mesh, case_outcome):
    check(case_outcome(zoo_case, CASES, case_name), mesh)


# --- the README's supported-model table ---------------------------------------------------------------

README_BEGIN = "<!-- hf-zoo-table: generated by `python tests/dist/test_hf_zoo.py --write-readme` -->"
README_END = "<!-- /hf-zoo-table -->"


def _verdict(outcome, mesh: str) -> tuple[str, str]:
    """("yes" or "fails", what a reader of the run wants to know: the largest deviation from one
    process, or the failure's first lines)."""
    try:
        check(outcome, mesh)
    except AssertionError as error:
        lines = [line for line in str(error).splitlines() if "failed:" in line or "Error" in line]
        return "fails", " | ".join(lines[-3:])[:600] or str(error)[:600]
    deviation = max(abs(loss - ref) / max(1.0, abs(ref)) for values in outcome.values
                    for loss, ref in zip(values[mesh]["losses"], values[mesh]["reference"]))
    return "yes", f"max deviation from one process {deviation:.1e}"


def run_zoo(architectures: list[str]) -> dict:
    """Outcomes of every case of these architectures, one job per world size (smallest first:
    it leaves the plans and one-process losses for the next)."""
    from harness import run_cases

    outcomes = {}
    sizes = sorted({MESHES[mesh][0] for mesh in CHOSEN_MESHES})
    for size in sizes:
        cases = {name: replace(case, later_sizes=tuple(later for later in sizes if later > size))
                 for name, case in CASES.items() if case.world_size == size and case.arch in architectures}
        started = time.perf_counter()
        outcomes.update(run_cases(zoo_case, size, cases, timeout_per_case_s=max(c.timeout_s for c in cases.values())))
        print(f"{size} processes: {len(cases)} architectures in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
    return outcomes


def zoo_table(architectures: list[str] | None = None) -> str:
    """Runs the zoo (both world sizes) and returns the markdown table; each cell's detail goes
    to stderr."""
    import transformers

    chosen = [arch for arch in hf_zoo.ARCHITECTURES + hf_zoo.RECENT + hf_zoo.HELD_OUT
              if (architectures is None and arch in hf_zoo.TESTED) or (architectures and arch.name in architectures)]
    outcomes = run_zoo([arch.name for arch in chosen])
    header = ["architecture", "kind", *CHOSEN_MESHES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arch in chosen:
        cells = []
        for mesh in CHOSEN_MESHES:
            verdict, detail = _verdict(outcomes[f"{arch.name}-{MESHES[mesh][0]}"], mesh)
            print(f"{arch.name} {mesh}: {verdict}: {detail}", file=sys.stderr, flush=True)
            cells.append(verdict)
        lines.append("| " + " | ".join([arch.name, arch.kind, *cells]) + " |")
    lines.append("")
    lines.append(f"transformers {transformers.__version__}, default attention, fp32, {NUM_STEPS} SGD steps on gloo: "
                 f"\"yes\" = every rank's losses within {TOLERANCE:g} of one process.")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """`--write-readme`: run the whole zoo and put the table in README.md; `ARCH ...`: print the
    table of some architectures only."""
    names = [arg for arg in argv if not arg.startswith("--")]
    unknown = [name for name in names if name not in hf_zoo.BY_NAME]
    if unknown or (names and "--write-readme" in argv):
        raise SystemExit(f"unknown architectures {unknown}; known: {', '.join(hf_zoo.BY_NAME)}" if unknown else
                         "--write-readme runs the whole zoo: give no architecture names with it")
    table = zoo_table(names or None)
    if "--write-readme" not in argv:
        print(table)
        return
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text()
    begin, end = text.index(README_BEGIN), text.index(README_END)
    readme.write_text(text[:begin + len(README_BEGIN)] + "\n" + table + "\n" + text[end:])
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])

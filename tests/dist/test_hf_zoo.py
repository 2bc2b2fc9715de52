"""Hugging Face models as users have them, under every plan kind, match one process.

Every architecture of hf_zoo.py (default attention, keyword inputs, a loss reading
`out.logits`) is trained for NUM_STEPS SGD steps in fp32 under dp2, tp2, pp2, dp2 x tp2 and
pp2 x tp2 (interleaved), with plans forced by constraints, and its losses must match one
process within TOLERANCE. The meshes of one world size run in one job of gloo processes (the
harness's `run_cases`): starting processes and importing transformers is most of a tiny case's
time.

`python tests/dist/test_hf_zoo.py --table` runs the zoo and prints the README's supported-model
table (architecture x plan kind).

`make test` runs the DEFAULT_ARCHITECTURES (one of each kind and every model the hard cases came
from: tied embeddings, MoE experts, encoder-decoders, lift_fresh_copy, vision) under every mesh;
the whole zoo of 25 takes about 14 minutes of a 2-core machine, so it runs with AUTOPAR_ZOO=all
(without it the other architectures' tests are not collected).
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_zoo  # noqa: E402
from harness import case_outcome, tiny_model_cluster  # noqa: E402,F401 (a fixture)

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 4
NUM_STEPS = 3
LEARNING_RATE = 0.1
TOLERANCE = 1e-4

MESHES = {
    "dp2": (2, dict(dp=2, tp=1, pp=1, zero_stage=0)),
    "tp2": (2, dict(dp=1, tp=2, pp=1)),
    "pp2": (2, dict(dp=1, tp=1, pp=2, microbatch_size=1, schedule="1f1b")),
    "dp2xtp2": (4, dict(dp=2, tp=2, pp=1, zero_stage=0)),
    "pp2xtp2": (4, dict(dp=1, tp=2, pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2,
                        zero_stage=0)),
}


@dataclass(frozen=True)
class ZooCase:
    """One architecture under every mesh of one world size (one capture serves them all)."""

    arch: str
    world_size: int
    timeout_s: float = 180.0
    """How long the case may run (capture, planning and every mesh of this world size)."""

    @property
    def meshes(self) -> list[str]:
        return [mesh for mesh, (size, _) in MESHES.items() if size == self.world_size]


def _reference(model, loss_fn, batches) -> list[float]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for inputs, targets in batches:
        loss = loss_fn(model(**inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def zoo_case(case: ZooCase) -> dict:
    """Per mesh: this rank's losses over NUM_STEPS steps, one process's, and what the plan shards.

    Rank 0 captures the model for planning once (keyword inputs and loss as a user passes them
    to `autopar.plan`) and plans every mesh from it; every rank captures it for codegen once and
    builds each mesh's module from that capture, as `autopar.parallelize` does."""
    import torch.distributed as dist

    from autopar.api import Constraints, plan_with, planner_for
    from autopar.capture import capture_program
    from autopar.codegen.parallelize import build_parallel_module
    from autopar.codegen.runtime import broadcast_object

    arch = hf_zoo.BY_NAME[case.arch]
    torch.manual_seed(0)
    model = arch.build()
    generator = torch.Generator().manual_seed(1)
    batches = [hf_zoo.batch(arch, GLOBAL_BATCH, generator) for _ in range(NUM_STEPS)]
    loss_fn = hf_zoo.loss_for(arch)
    reference = _reference(model, loss_fn, batches)
    example_inputs, example_targets = batches[0]
    plans = None
    if dist.get_rank() == 0:
        planner = planner_for(model, example_inputs, tiny_model_cluster(case.world_size),
                              global_batch=GLOBAL_BATCH, loss_fn=loss_fn, example_targets=example_targets,
                              precision="fp32")
        plans = {mesh: plan_with(planner, Constraints.from_value(MESHES[mesh][1])) for mesh in case.meshes}
    plans = broadcast_object(plans)
    results = {}
    captured = capture_program(model, (), example_inputs, allow_fallback=False)
    for mesh in case.meshes:
        try:
            module = build_parallel_module(model, (), plans[mesh], loss_fn, example_inputs, captured=captured)
            optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
            losses = []
            for inputs, targets in batches:
                losses.append(module.train_step(inputs, targets).item())
                optimizer.step()
                optimizer.zero_grad()
        except Exception as error:
            raise RuntimeError(f"{case.arch} under {mesh} failed: {type(error).__name__}: {error}") from error
        plan = module.plan
        results[mesh] = dict(losses=losses, reference=reference, mesh=plan.mesh, schedule=plan.schedule,
                             sharded=sorted(name for name, placement in plan.param_placements.items()
                                            if placement != "R"))
    return results


DEFAULT_ARCHITECTURES = ("GPT-2", "Llama", "Falcon", "Mixtral", "Qwen2-MoE", "T5", "BART", "ViT")
RUN_ALL = os.environ.get("AUTOPAR_ZOO", "") == "all"

CASES = {f"{arch.name}-{size}": ZooCase(arch.name, size) for size in (2, 4) for arch in hf_zoo.ARCHITECTURES}
TESTS = [(f"{arch.name}-{size}", mesh) for mesh, (size, _) in MESHES.items() for arch in hf_zoo.ARCHITECTURES
         if RUN_ALL or arch.name in DEFAULT_ARCHITECTURES]


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


def _verdict(outcome, mesh: str) -> str:
    try:
        check(outcome, mesh)
    except AssertionError:
        return "fails"
    return "yes"


def zoo_table() -> str:
    """Runs the whole zoo (both world sizes) and returns the markdown table."""
    from harness import run_cases

    outcomes = {}
    for size in (2, 4):
        cases = {name: case for name, case in CASES.items() if case.world_size == size}
        outcomes.update(run_cases(zoo_case, size, cases, timeout_per_case_s=max(c.timeout_s for c in cases.values())))
    import transformers

    header = ["architecture", "kind", *MESHES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arch in hf_zoo.ARCHITECTURES:
        cells = [_verdict(outcomes[f"{arch.name}-{MESHES[mesh][0]}"], mesh) for mesh in MESHES]
        lines.append("| " + " | ".join([arch.name, arch.kind, *cells]) + " |")
    lines.append("")
    lines.append(f"transformers {transformers.__version__}, default attention, fp32, {NUM_STEPS} SGD steps on gloo: "
                 f"\"yes\" = every rank's losses within {TOLERANCE:g} of one process.")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    table = zoo_table()
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

"""Bad input stops every rank with the same clear error, and nothing hangs.

Bad plans, world sizes and batches raise PlanMismatchError; an unexpected error while rank 0
plans (a planner bug) must reach the other ranks too, which otherwise wait for the plan forever.

Each case runs on 2 gloo processes; every rank records the exception it got (the test fails if
one rank raised nothing, raised something else, or hung: the harness kills a job that stops
making progress and reports where each rank was).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
GLOBAL_BATCH = 8
GPT_SPEC = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0"
WIDER_GPT_SPEC = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64,dropout=0.0"


@dataclass(frozen=True)
class Case:
    kind: str
    folder: str
    """A folder every rank can read (plan files are written there)."""
    world_size: int = WORLD_SIZE


def _bundle(spec: str = GPT_SPEC, batch_size: int = GLOBAL_BATCH):
    from autopar.models import build_model

    return build_model(spec, device="cpu", seed=0, batch_size=batch_size)


def _plan_file(case: Case, spec: str, num_devices: int) -> str:
    """Rank 0 plans `spec` for `num_devices` and saves the plan; every rank gets its path."""
    import autopar
    import torch.distributed as dist

    path = Path(case.folder) / f"{case.kind}.plan.json"
    if dist.get_rank() == 0:
        bundle = _bundle(spec)
        plan = autopar.plan(bundle.model, bundle.example_inputs, tiny_model_cluster(num_devices),
                            global_batch=GLOBAL_BATCH, loss_fn=bundle.loss_fn,
                            example_targets=bundle.example_targets, precision="fp32")
        plan.save(path)
    dist.barrier()
    return str(path)


def _parallelize(bundle, **options):
    import autopar

    return autopar.parallelize(bundle.model, tiny_model_cluster(WORLD_SIZE), bundle.example_inputs,
                               loss_fn=bundle.loss_fn, example_targets=bundle.example_targets, **options)


def error_case(case: Case) -> dict:
    """The exception this rank got from the bad input (None when it got none)."""
    bundle = _bundle()
    try:
        if case.kind == "plan_for_another_model":
            _parallelize(bundle, plan=_plan_file(case, WIDER_GPT_SPEC, WORLD_SIZE))
        elif case.kind == "plan_for_another_world_size":
            _parallelize(bundle, plan=_plan_file(case, GPT_SPEC, 2 * WORLD_SIZE))
        elif case.kind == "batch_not_the_planned_one":
            module = _parallelize(bundle, constraints={"dp": WORLD_SIZE})
            # Neither the global batch nor one rank's data-parallel share of it (per-rank data).
            other = _bundle(batch_size=GLOBAL_BATCH + GLOBAL_BATCH // 2)
            module.train_step(other.example_inputs, other.example_targets)
        elif case.kind == "sequence_not_the_traced_one":
            module = _parallelize(bundle, constraints={"dp": WORLD_SIZE})
            tokens = bundle.example_inputs[0][:, : bundle.example_inputs[0].shape[1] // 2]
            module.train_step((tokens,), bundle.example_targets[:, : tokens.shape[1]])
        elif case.kind == "missing_plan_file":
            _parallelize(bundle, plan=str(Path(case.folder) / "no-such-plan.json"))
        elif case.kind == "corrupt_plan_file":
            path = Path(case.folder) / "corrupt.plan.json"
            _write_whole(path, '{"schema_version": 1, "model": "GPT", "mesh": {"pp": 1,')  # cut short
            _parallelize(bundle, plan=str(path))
        elif case.kind == "internal_error_while_planning":
            with _broken_planner():
                _parallelize(bundle)
        elif case.kind == "plan_file_missing_fields":
            path = Path(case.folder) / "partial.plan.json"
            _write_whole(path, '{"schema_version": 1, "model": "GPT"}')
            _parallelize(bundle, plan=str(path))
        else:
            raise ValueError(f"unknown case {case.kind}")
    except Exception as error:  # noqa: BLE001 - the error is the result
        return dict(type=type(error).__name__, message=str(error))
    return dict(type=None, message="")


def _write_whole(path: Path, text: str) -> None:
    """Every rank writes the same file: replace it whole, so no rank reads another's half-written copy."""
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


@contextmanager
def _broken_planner():
    """autopar.plan fails (on rank 0, the rank that plans) with an error that is not an AutoparError."""
    from autopar.plans import planning

    def crash(*args, **kwargs):
        raise RuntimeError("the planner crashed")

    working, planning.plan = planning.plan, crash
    try:
        yield
    finally:
        planning.plan = working


# case -> (the exception every rank must raise, what its message must say)
KINDS = {
    "plan_for_another_model": ("PlanMismatchError", "fingerprint"),
    "plan_for_another_world_size": ("PlanMismatchError", "4 devices"),
    "batch_not_the_planned_one": ("PlanMismatchError", "global batch of 8"),
    "sequence_not_the_traced_one": ("PlanMismatchError", "traced shape"),
    "missing_plan_file": ("PlanMismatchError", "no-such-plan.json"),
    "corrupt_plan_file": ("PlanMismatchError", "not valid JSON"),
    "plan_file_missing_fields": ("PlanMismatchError", "re-run `autopar plan`"),
    "internal_error_while_planning": ("RuntimeError", "the planner crashed"),
}


@pytest.fixture(scope="module")
def plan_folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("plans"))


@pytest.mark.parametrize("case_name", list(KINDS))
def test_every_rank_raises(case_name, plan_folder, case_outcome):
    cases = {kind: Case(kind, plan_folder) for kind in KINDS}
    outcome = case_outcome(error_case, cases, case_name)
    assert outcome.ok, outcome.error
    expected_type, expected_text = KINDS[case_name]
    for rank, result in enumerate(outcome.values):
        assert result["type"] is not None, f"rank {rank} raised nothing"
        assert result["type"] == expected_type, f"rank {rank} raised {result['type']}: {result['message']}"
        assert expected_text in result["message"], f"rank {rank}: unclear message: {result['message']}"
    assert len({result["message"] for result in outcome.values}) == 1, "ranks disagree on the error"

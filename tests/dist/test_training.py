"""Training real models: meta-device init, DCP checkpoints across plans and world sizes, Hugging
Face safetensors, per-rank data and gradient clipping (exit codes: test_finished_jobs.py).

Jobs, in order (one process group each, cases one after the other):
  4 ranks: meta init under dp2 x tp2 (+ per-rank data, clipping); train under plan A and save
           mid-run (two plans A); resume each checkpoint under its plan B (another mesh);
  2 ranks: resume a 4-rank checkpoint on 2 ranks; meta init under FSDP; a safetensors file
           written here loaded into a tensor-parallel model.
A resumed run must continue the uninterrupted run's loss curve (fp32, 1e-5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from harness import run_cases, tiny_model_cluster
from one_process import parallelize_reusing_captures

pytestmark = pytest.mark.dist

SPEC = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64"
GLOBAL_BATCH = 8
NUM_STEPS = 6
SAVE_AFTER = 3
LEARNING_RATE = 1e-2
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Case:
    kind: str
    world_size: int
    constraints: dict = field(default_factory=dict)
    folder: str = ""
    checkpoint: str = ""
    expected: tuple = ()


def _bundle(device: str):
    from autopar.models import build_model

    return build_model(SPEC, device=device, seed=0 if device != "meta" else None, batch_size=GLOBAL_BATCH)


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator),
             torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)) for _ in range(NUM_STEPS)]


_PLANS: dict = {}
"""Plans by constraints, within one job (planning is most of a small case's time)."""


def _parallelize(model, case: Case, **kwargs):
    """`autopar.parallelize(model, ...)` for this case's constraints; the planning and codegen
    captures are made once per job and device (meta or CPU: a meta capture bakes in meta
    factories) and reused by later cases (one_process.py), plans once per constraints."""
    tokens, targets = _batches()[0]
    key = tuple(sorted(case.constraints.items()))
    device = next(model.parameters()).device.type
    pm = parallelize_reusing_captures(("training", device), model, tiny_model_cluster(case.world_size), (tokens,),
                                      loss_fn=_bundle("meta").loss_fn, example_targets=targets,
                                      constraints=case.constraints, plan=_PLANS.get(key), **kwargs)
    _PLANS[key] = pm.plan
    return pm


def _full_state(pm) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor, from whichever rank holds it."""
    import torch.distributed as dist

    mine = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in pm.state_dict().items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: value for state in gathered for name, value in state.items()}


def _adam(parameters):
    return torch.optim.AdamW(parameters, lr=LEARNING_RATE)


# --- cases -------------------------------------------------------------------------------------

def training_case(case: Case):
    return {"meta_init": _meta_init, "train_and_save": _train_and_save, "resume": _resume,
            "safetensors": _safetensors}[case.kind](case)


def _meta_init(case: Case) -> dict:
    """Meta-built llama under a plan: each rank's storage is its shards only; replicated
    parameters equal the one-device keyed init; replicas agree (the loss equals one device's
    on the gathered weights); per-rank data gives the gradients of the global batch."""
    from autopar.codegen.init import seeded_init

    torch.manual_seed(7)
    pm = _parallelize(_bundle("meta").model, case)
    reference = _bundle("cpu").model
    seeded_init(reference, 7)
    full = _full_state(pm)
    sharded = _sharded_names(pm)
    unsharded_equal = {name: bool(torch.equal(full[name], value)) for name, value in reference.state_dict().items()
                       if name in full and name not in sharded}
    stds = {name: full[name].std().item() for name in sharded if full[name].dim() == 2}
    # Shards are drawn from their own streams: no half of a sharded weight repeats the other.
    repeated = [name for name in stds if any(torch.equal(*full[name].chunk(2, dim)) for dim in (0, 1))]
    local_numel = sum(value.to_local().numel() if hasattr(value, "to_local") else value.numel()
                      for value in pm.state_dict().values())
    reference.load_state_dict(full, strict=False)
    tokens, targets = _batches()[0]
    reference_loss = _bundle("meta").loss_fn(reference(tokens), targets)
    reference_loss.backward()
    loss_global = pm.train_step((tokens,), targets).item()
    grads_global = {name: _full(param.grad) for name, param in pm.named_model_parameters().items()}
    for param in pm.parameters():
        param.grad = None
    share = GLOBAL_BATCH // pm.dp_size
    rows = slice(pm.dp_rank * share, (pm.dp_rank + 1) * share)
    loss_local = pm.train_step((tokens[rows],), targets[rows]).item()
    grad_diff = max((_full(param.grad) - grads_global[name]).abs().max().item()
                    for name, param in pm.named_model_parameters().items())
    return dict(unsharded_equal=unsharded_equal, stds=stds, repeated=repeated, local_numel=local_numel,
                total_numel=sum(value.numel() for value in reference.parameters()),
                loss=loss_global, loss_local=loss_local, reference_loss=reference_loss.item(), grad_diff=grad_diff,
                clip=_clip_against(pm, reference))


def _clip_against(pm, reference) -> dict:
    """clip_grad_norm_ on pm's gradients (left by train_step) against torch's on `reference`
    (same weights, gradients of the same batch)."""
    max_norm = 0.05
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item()
    norm = pm.clip_grad_norm_(max_norm).item()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}
    errors = {name: (_full(param.grad) - reference_grads[name]).abs().max().item()
              for name, param in pm.named_model_parameters().items()}
    return dict(norm=norm, reference_norm=reference_norm, grad_errors=errors)


def _sharded_names(pm) -> set[str]:
    """Parameters some rank holds only a shard of (by tensor parallelism or FSDP), on every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    mine = {name for name, value in pm.state_dict().items()
            if isinstance(value, DTensor) and any(isinstance(p, Shard) for p in value.placements)}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return set().union(*gathered)


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _train_and_save(case: Case) -> dict:
    """Plan A: real seeded weights, Adam; save after SAVE_AFTER steps; go on to NUM_STEPS."""
    pm = _parallelize(_bundle("cpu").model, case)
    optimizer = _adam(pm.parameters())
    losses = []
    for step, (tokens, targets) in enumerate(_batches()):
        if step == SAVE_AFTER:
            pm.save(case.checkpoint, optimizer=optimizer, extra={"step": step, "note": {"plan": str(pm.plan.mesh)}})
        losses.append(pm.train_step((tokens,), targets).item())
        optimizer.step()
        optimizer.zero_grad()
    return dict(losses=losses, complete=(Path(case.checkpoint) / ".metadata").is_file(),
                leftovers=sorted(path.name for path in Path(case.checkpoint).parent.iterdir()
                                 if path.name.endswith((".partial", ".old"))))


def _resume(case: Case) -> dict:
    """Plan B (another mesh or world size): a meta model, loaded from plan A's checkpoint."""
    torch.manual_seed(123)  # another init than plan A's: the checkpoint must overwrite all of it
    pm = _parallelize(_bundle("meta").model, case)
    optimizer = _adam(pm.parameters())
    extra = pm.load(case.checkpoint, optimizer=optimizer)
    losses = []
    for tokens, targets in _batches()[extra["step"]:]:
        losses.append(pm.train_step((tokens,), targets).item())
        optimizer.step()
        optimizer.zero_grad()
    reference = _bundle("cpu").model
    reference.load_state_dict(_full_state(pm), strict=False)
    tokens, targets = _batches()[0]
    _bundle("meta").loss_fn(reference(tokens), targets).backward()
    pm.train_step((tokens,), targets)
    return dict(losses=losses, extra=extra, mesh=dict(pm.plan.mesh), zero_stage=pm.plan.zero_stage,
                clip=_clip_against(pm, reference))


def _safetensors(case: Case) -> dict:
    """A safetensors file (written by the test) loaded into a tensor-parallel meta model."""
    bundle = _bundle("cpu")
    pm = _parallelize(_bundle("meta").model, case, init_fn=case.checkpoint)
    tokens, targets = _batches()[0]
    full = _full_state(pm)
    exact = all(torch.equal(full[name], value) for name, value in bundle.model.state_dict().items() if name in full)
    return dict(exact=exact, loss=pm.train_step((tokens,), targets).item(),
                reference_loss=bundle.loss_fn(bundle.model(tokens), targets).item())


# --- the jobs ----------------------------------------------------------------------------------

PLAN_PAIRS = {
    "dp2xtp2->pp2xtp2": (dict(dp=2, tp=2, pp=1, zero_stage=0), dict(dp=1, tp=2, pp=2, microbatch_size=2)),
    "pp2xdp2->dp4-zero3": (dict(dp=2, tp=1, pp=2, microbatch_size=2),
                           dict(dp=4, tp=1, pp=1, zero_stage=3, microbatch_size=2)),
}
RESUME_ON_2 = dict(dp=1, tp=2, pp=1)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    four = {"meta_init": Case("meta_init", 4, dict(dp=2, tp=2, pp=1, zero_stage=0))}
    for name, (plan_a, _) in PLAN_PAIRS.items():
        four[f"save:{name}"] = Case("train_and_save", 4, plan_a, checkpoint=str(folder / name / "step-3"))
    for name, (_, plan_b) in PLAN_PAIRS.items():  # cases run in order: each resume after its save
        four[f"resume:{name}"] = Case("resume", 4, plan_b, checkpoint=four[f"save:{name}"].checkpoint)
    results = run_cases(training_case, 4, four, setup_timeout_s=240, timeout_per_case_s=240)
    _write_safetensors(folder / "hf" / "model.safetensors")
    two = {"resume-4->2": Case("resume", 2, RESUME_ON_2, checkpoint=four["save:dp2xtp2->pp2xtp2"].checkpoint),
           "meta_init_fsdp": Case("meta_init", 2, dict(dp=2, tp=1, pp=1, zero_stage=3, microbatch_size=2)),
           "safetensors": Case("safetensors", 2, dict(dp=1, tp=2, pp=1), checkpoint=str(folder / "hf"))}
    results.update(run_cases(training_case, 2, two, setup_timeout_s=240, timeout_per_case_s=240))
    if os.environ.get("AUTOPAR_TEST_DUMP"):
        import pickle

        Path(os.environ["AUTOPAR_TEST_DUMP"]).write_bytes(pickle.dumps(results))
    return results


def _write_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: value.contiguous() for name, value in _bundle("cpu").model.state_dict().items()}, str(path))


def _values(outcomes, name):
    outcome = outcomes[name]
    if not outcome.ok:
        raise AssertionError(outcome.error)
    return outcome.values


@pytest.mark.parametrize("name", ["meta_init", "meta_init_fsdp"])
def test_meta_init_materialises_only_shards_and_matches_one_device(outcomes, name):
    results = _values(outcomes, name)
    for rank, result in enumerate(results):
        assert all(result["unsharded_equal"].values()), (rank, result["unsharded_equal"])
        assert result["unsharded_equal"] or name == "meta_init_fsdp", "no unsharded parameter was compared"
        assert not result["repeated"], result["repeated"]
        for param, std in result["stds"].items():
            assert 0.015 < std < 0.025, (param, std)  # normal(0, 0.02) over the whole tensor
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=TOLERANCE)
        assert result["local_numel"] < result["total_numel"], "a rank holds the whole model"
        assert result["loss_local"] == pytest.approx(result["loss"], abs=TOLERANCE), "per-rank data"
        assert result["grad_diff"] <= TOLERANCE, "per-rank data gives other gradients than the global batch"


@pytest.mark.parametrize("pair", list(PLAN_PAIRS))
def test_resume_under_another_plan_continues_the_loss_curve(outcomes, pair):
    saved = _values(outcomes, f"save:{pair}")[0]
    assert saved["complete"] and not saved["leftovers"], saved
    resumed = _values(outcomes, f"resume:{pair}")
    for rank, result in enumerate(resumed):
        assert result["extra"]["step"] == SAVE_AFTER and "plan" in result["extra"]["note"], result["extra"]
        assert result["losses"] == pytest.approx(saved["losses"][SAVE_AFTER:], abs=TOLERANCE), rank


def test_resume_on_another_world_size(outcomes):
    saved = _values(outcomes, "save:dp2xtp2->pp2xtp2")[0]
    for result in _values(outcomes, "resume-4->2"):
        assert result["mesh"]["tp"] == 2 and result["mesh"]["dp"] * result["mesh"]["pp"] == 1
        assert result["losses"] == pytest.approx(saved["losses"][SAVE_AFTER:], abs=TOLERANCE)


@pytest.mark.parametrize("name", ["meta_init", "meta_init_fsdp", "resume:dp2xtp2->pp2xtp2", "resume-4->2"])
def test_clip_grad_norm_matches_one_device(outcomes, name):
    """dp x tp, FSDP, pp x tp, tp."""
    results = [result["clip"] for result in _values(outcomes, name)]
    for result in results:
        assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        assert result["reference_norm"] > 0.05, "the test clips nothing"
        for param, error in result["grad_errors"].items():
            assert error <= 1e-6, (param, error)
    assert set().union(*(result["grad_errors"] for result in results)) == set(
        dict(_bundle("meta").model.named_parameters()))


def test_safetensors_file_loads_into_a_sharded_model(outcomes):
    for result in _values(outcomes, "safetensors"):
        assert result["exact"]
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=TOLERANCE)

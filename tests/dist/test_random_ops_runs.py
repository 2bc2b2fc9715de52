"""Random ops under tensor parallelism (codegen/random_ops.py) on gloo processes.

- Every kind of random op the interpreter meets, run on a tp mesh of 2 whose ranks start from
  different generators: after the step's GeneratorSync both ranks hold the same values for a
  replicated output, and the shards of a sharded one put together are one process's draw from
  the first rank's state.
- A GPT with dropout 0.1 trained 3 SGD steps under tp2 (with and without full recomputation,
  whose backward draws again from the restored generator state) equals one process drawing from
  the same seed (1e-4); under dp2 and dp2 x tp2 each replica draws for its own rows from the shared seed
  (as DDP does), which equals one process running each replica's rows from the same generator
  state and averaging the gradients (`train_per_replica`), and the tp2 inside each replica
  changes nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness import case_outcome, run_workers  # noqa: F401 (case_outcome: a fixture)
from one_process import CaseTable, case_param

pytestmark = pytest.mark.dist

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.1"
SDPA_SPEC = SPEC + ",attention=sdpa"
"""Attention's dropout inside scaled_dot_product_attention (dropout_p=0.1)."""
GLOBAL_BATCH, SEQ, VOCAB, NUM_STEPS, LEARNING_RATE, SEED = 4, 16, 64, 3, 0.1, 123
TOLERANCE = 1e-4


def random_ops_worker() -> dict:
    """Each random op's output on this rank, as a whole tensor, and one process's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.codegen.interpreter import PlannedInterpreter
    from autopar.codegen.random_ops import GeneratorSync

    aten = torch.ops.aten
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    probabilities = torch.rand(4, 6)
    calls = [  # (name, target, input placement, args after the input, planned output placement)
        ("dropout of a shard", aten.dropout.default, Shard(1), (0.5, True), "S1"),
        ("dropout replicated", aten.dropout.default, Replicate(), (0.5, True), "R"),
        ("native_dropout of a shard", aten.native_dropout.default, Shard(2), (0.3, True), "S2"),
        ("rand_like of a shard", aten.rand_like.default, Shard(0), (), "S0"),
        ("randn_like replicated, planned sharded", aten.randn_like.default, Replicate(), (), "S1"),
        ("exponential_ of a shard", aten.exponential_.default, Shard(1), (), "S1"),
        ("uniform_ replicated", aten.uniform_.default, Replicate(), (0.0, 1.0), "R"),
        ("bernoulli of sharded probabilities", aten.bernoulli.default, Shard(0), (), "S0"),
    ]
    torch.manual_seed(1000 + dist.get_rank())  # the ranks' generators differ before the step's sync
    GeneratorSync(mesh.get_group(), torch.device("cpu"))()
    interpreter = PlannedInterpreter({}, mesh)
    parallel = {}
    for name, target, placement, rest, planned in calls:
        source = probabilities if target is aten.bernoulli.default else x
        value = distribute_tensor(source.clone(), mesh, [placement])
        node = type("Node", (), {"name": name, "target": target})()
        result = interpreter._run_op(node, (value, *rest), {}, planned)
        parallel[name] = [item.full_tensor() for item in (result if isinstance(result, tuple) else (result,))]
    torch.manual_seed(1000)  # one process, from the first tp rank's state
    reference = {}
    for name, target, _, rest, _ in calls:
        source = probabilities if target is aten.bernoulli.default else x
        result = target(source.clone(), *rest)
        reference[name] = list(result if isinstance(result, tuple) else (result,))
    return dict(parallel=parallel, reference=reference, gathered=dict(interpreter.stats.random_gathered))


def test_random_ops_draw_one_process_numbers_on_every_tp_rank():
    results = run_workers(random_ops_worker, world_size=2)
    for rank, result in enumerate(results):
        for name, values in result["parallel"].items():
            for index, (value, expected) in enumerate(zip(values, result["reference"][name], strict=True)):
                assert torch.equal(value, results[0]["parallel"][name][index]), f"rank {rank} differs from rank 0: {name}"
                assert torch.allclose(value.float(), expected.float(), atol=1e-6), f"rank {rank}: {name}"
        assert result["gathered"] == {"aten.bernoulli.default": 1}, result["gathered"]


# --- a GPT with dropout, trained ------------------------------------------------------------------

def train_per_replica(model, loss_fn, batches, dp: int) -> list[float]:
    """One process as dp replicas seeded alike run: each step, each replica's rows from the same
    generator state (the state every replica is in), gradients averaged over the replicas."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    torch.manual_seed(SEED)
    losses = []
    for (tokens,), targets in batches:
        state, rows, total = torch.get_rng_state(), tokens.shape[0] // dp, 0.0
        for replica in range(dp):
            torch.set_rng_state(state)
            mine = slice(replica * rows, (replica + 1) * rows)
            loss = loss_fn(model(tokens[mine]), targets[mine])
            (loss / dp).backward()
            total += loss.item() / dp
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def dropout_case(case) -> dict:
    """This rank's losses under the case's plan, and one process's (per replica when dp > 1)."""
    from autopar.models import build_model
    from harness import tiny_model_cluster
    from one_process import parallelize_reusing_captures

    bundle = build_model(case.spec, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator),),
                torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)) for _ in range(NUM_STEPS)]
    dp = case.constraints.get("dp", 1)
    reference = train_per_replica(bundle.model, bundle.loss_fn, batches, dp)
    (inputs, targets), *_ = batches
    module = parallelize_reusing_captures(case.spec, bundle.model, tiny_model_cluster(case.world_size), inputs,
                                          loss_fn=bundle.loss_fn, example_targets=targets,
                                          constraints=case.constraints)
    torch.manual_seed(SEED)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    losses = []
    for step_inputs, step_targets in batches:
        losses.append(module.train_step(step_inputs, step_targets).item())
        optimizer.step()
        optimizer.zero_grad()
    dropouts = [name for name in module.plan.placements if name.startswith("dropout")]  # export's node names
    return dict(losses=losses, reference=reference, random_ops=module.random_ops, mesh=dict(module.plan.mesh),
                gathered=dict(module.stats.random_gathered),
                attention_outputs=sorted({placement.split("|")[0] for name, placement in module.plan.placements.items()
                                          if name.startswith("scaled_dot_product_attention")}),
                dropout_outputs=sorted({module.plan.placements.get(name, "R").split("|")[0] for name in dropouts}),
                microbatches=module.plan.num_microbatches, sharded=[name for name, placement
                                                                     in module.plan.param_placements.items()
                                                                     if placement != "R"])


class _Case:
    def __init__(self, world_size: int, constraints: dict, spec: str = SPEC) -> None:
        self.world_size, self.constraints, self.spec, self.timeout_s = world_size, constraints, spec, 150.0


TABLE = CaseTable([
    case_param(_Case(2, dict(dp=1, tp=2, pp=1, microbatch_size=4)), "gpt-dropout-tp2"),
    case_param(_Case(2, dict(dp=1, tp=2, pp=1, microbatch_size=4, recompute="full")), "gpt-dropout-tp2-recompute"),
    case_param(_Case(2, dict(dp=1, tp=2, pp=1, microbatch_size=4, recompute="selective")),
               "gpt-dropout-tp2-selective"),
    case_param(_Case(2, dict(dp=1, tp=2, pp=1, microbatch_size=4), SDPA_SPEC), "gpt-sdpa-dropout-tp2"),
    case_param(_Case(2, dict(dp=2, tp=1, pp=1, zero_stage=0, microbatch_size=2)), "gpt-dropout-dp2"),
    case_param(_Case(4, dict(dp=2, tp=2, pp=1, zero_stage=0, microbatch_size=2)), "gpt-dropout-dp2xtp2"),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_dropout_under_tp_equals_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, dropout_case, case_name)
    first = results[0]
    assert first["mesh"]["tp"] == case.constraints["tp"] and first["mesh"]["dp"] == case.constraints["dp"]
    assert first["microbatches"] == 1, first
    assert "aten.dropout.default" in first["random_ops"], first["random_ops"]
    assert ("aten.scaled_dot_product_attention.default" in first["random_ops"]) == (case.spec == SDPA_SPEC)
    assert not first["gathered"], first["gathered"]  # attention's dropout drawn on the shards, not gathered
    if case.spec == SDPA_SPEC:
        assert first["attention_outputs"] == ["S1"], first["attention_outputs"]  # split by heads
    if case.constraints["tp"] > 1:
        assert first["sharded"], "the plan shards no parameter: the tp case tests nothing"
        assert any(placement.startswith("S") for placement in first["dropout_outputs"]), first["dropout_outputs"]
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(result["reference"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}: {result['losses']} vs one process {result['reference']}"

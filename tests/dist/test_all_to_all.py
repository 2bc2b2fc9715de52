"""codegen/all_to_all.py: a shard-dim change on gloo is one all-to-all each way, with DTensor's
values and layout, uneven shards included.

Two gloo ranks move tensors from Shard(d) to Shard(d') with `shard_to_shard` and with DTensor's
own `redistribute` (an all-gather and a slice on CPU), and compare: the same local shards, the
same input gradient, and exactly one all-to-all in forward and one in backward (no all-gather).
"""

from __future__ import annotations

import pytest

from harness import run_workers

pytestmark = pytest.mark.dist

CASES = [((4, 6, 8), 1, 2), ((5, 3, 4), 0, 2), ((5, 3, 4), 2, 1), ((3, 7), 1, 0)]
"""(global shape, source dim, target dim): even, and uneven on either side (rank 1 holds less)."""


def exchange_worker(cases) -> list[dict]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.codegen.all_to_all import runs_own_all_to_all, shard_to_shard

    mesh = init_device_mesh("cpu", (2,))
    results = []
    for shape, source, target in cases:
        generator = torch.Generator().manual_seed(0)
        full = torch.randn(shape, generator=generator)
        weight = torch.randn(shape, generator=generator)
        outcome = {}
        for how in ("own", "dtensor"):
            value = distribute_tensor(full, mesh, [Shard(source)]).requires_grad_()
            weights = distribute_tensor(weight, mesh, [Shard(target)])
            counter = CommDebugMode()
            with counter:
                moved = shard_to_shard(value, target) if how == "own" else value.redistribute(mesh, [Shard(target)])
                (moved * weights).to_local().sum().backward()
            outcome[how] = dict(local=moved.to_local().detach().clone(), placements=moved.placements,
                                grad=value.grad.to_local().clone(), grad_placements=value.grad.placements,
                                counts={str(op): count for op, count in counter.get_comm_counts().items()})
        results.append(dict(own_used=runs_own_all_to_all(distribute_tensor(full, mesh, [Shard(source)]), Shard(target)),
                            same_local=torch.equal(outcome["own"]["local"], outcome["dtensor"]["local"]),
                            same_grad=torch.allclose(outcome["own"]["grad"], outcome["dtensor"]["grad"]),
                            placements=(outcome["own"]["placements"], outcome["own"]["grad_placements"]),
                            counts=outcome["own"]["counts"]))
    return results


def test_shard_to_shard_is_one_all_to_all_each_way_with_dtensors_values():
    for rank_results in run_workers(exchange_worker, 2, (CASES,)):
        for (shape, source, target), result in zip(CASES, rank_results):
            where = f"{shape} S{source} -> S{target}"
            assert result["own_used"], where
            assert result["same_local"] and result["same_grad"], (where, result)
            assert [str(p) for p in result["placements"][0]] == [f"S({target})"], (where, result)
            assert [str(p) for p in result["placements"][1]] == [f"S({source})"], (where, result)
            kinds = {op.split(".")[-1]: count for op, count in result["counts"].items()}
            assert kinds == {"all_to_all_single": 2}, (where, result["counts"])

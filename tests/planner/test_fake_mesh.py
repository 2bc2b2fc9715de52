"""A plan for 1,024 GPUs, shape-checked on a real DeviceMesh of 1,024 ranks in one process (fake
process group): every parameter's tensor-parallel placement yields a DTensor of the right shape,
and tensor-parallel groups are consecutive ranks inside one node, as the cost model assumes."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.codegen.placements import to_dtensor_placement
from autopar.mesh import Mesh
from autopar.models import build_model
from autopar.strategies.placement import local_shape

WORLD = 1024


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def plan():
    return autopar.plan("gpt:layers=8,hidden=4096,heads=32,seq=2048,vocab=51200", cluster="dgx-a100-80g:nodes=128",
                        global_batch=1024, constraints={"tp": 8, "pp": 2})


def test_plan_placements_are_valid_dtensors_on_1024_ranks(fake_world, plan):
    mesh = init_device_mesh("cpu", (plan.mesh["pp"], plan.mesh["dp"], plan.mesh["tp"]),
                            mesh_dim_names=("pp", "dp", "tp"))
    tp_mesh = mesh["tp"]
    model = build_model(plan.model, device="meta").model
    for name, param in model.named_parameters():
        placement = plan.param_placements[name]
        local = local_shape(tuple(param.shape), [placement], (plan.mesh["tp"],))
        tensor = DTensor.from_local(torch.empty(local, device="meta"), tp_mesh, [to_dtensor_placement(placement)],
                                    run_check=False)
        assert tuple(tensor.shape) == tuple(param.shape), name


def test_tensor_parallel_groups_stay_inside_a_node(fake_world, plan):
    mesh = init_device_mesh("cpu", (plan.mesh["pp"], plan.mesh["dp"], plan.mesh["tp"]),
                            mesh_dim_names=("pp", "dp", "tp"))
    ranks = mesh["tp"].mesh.flatten().tolist()
    assert ranks == list(range(ranks[0], ranks[0] + plan.mesh["tp"]))
    assert len({rank // 8 for rank in ranks}) == 1
    layout = Mesh(axis_names=("pp", "dp", "tp"), shape=tuple(plan.mesh[a] for a in ("pp", "dp", "tp")),
                  devices_per_node=8)
    assert layout.group(2).num_nodes == 1 and layout.group(2).devices_per_node == 8
    assert layout.group(1).devices_per_node == 1  # each dp group: one GPU per node

"""FSDP2 units as codegen/data_parallel.apply_fsdp wraps a stage (on a fake process group)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.codegen.data_parallel import apply_fsdp, reshard_zero3_under_pipelining


class _Segment(nn.Module):
    has_experts = False

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))


class _Stage(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.segments = nn.ModuleList(_Segment() for _ in range(count))


@pytest.fixture(scope="module")
def dp_mesh():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield DeviceMesh("cpu", [0, 1])
    if created:
        dist.destroy_process_group()


def _resharded(module: nn.Module) -> bool:
    return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


@pytest.mark.parametrize("root_ends", [False, True])
def test_root_ends_leave_the_first_and_last_segments_to_the_root_and_keep_the_last_block(dp_mesh, root_ends):
    """Plan.fsdp_root_ends: the ends' parameters are the root unit's and the last block is not
    resharded after forward (as cost_model/fsdp.py's root_ends prices it); otherwise every segment
    is a unit resharded after forward under ZeRO-3."""
    stage = _Stage(5)
    apply_fsdp([stage], dp_mesh, 3, root_ends=root_ends)
    units = [index for index, segment in enumerate(stage.segments) if isinstance(segment, FSDPModule)]
    assert units == ([1, 2, 3] if root_ends else [0, 1, 2, 3, 4])
    root_params = stage._get_fsdp_state()._fsdp_param_group
    assert (root_params is not None) == root_ends  # the ends' weights
    assert [_resharded(stage.segments[index]) for index in units] == (
        [True, True, False] if root_ends else [True] * 5)


def _reshard_flags(stage: nn.Module) -> list[bool]:
    return [group.reshard_after_backward for module in stage.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups]


@pytest.mark.parametrize("pinned", [False, True])
def test_zero3_under_pipelining_stays_resharded_after_backward(dp_mesh, pinned):
    """torch.distributed.pipelining sets reshard_after_backward False on the stage before each
    microbatch's backward; under ZeRO-3 the stage's units keep resharding (as planned) once
    reshard_zero3_under_pipelining has pinned the setter."""
    stage = _Stage(3)
    apply_fsdp([stage], dp_mesh, 3)
    if pinned:
        reshard_zero3_under_pipelining([stage])
    stage.set_reshard_after_backward(False)  # what PipelineStage.backward_maybe_with_nosync calls
    assert _reshard_flags(stage) == [pinned] * 3  # the three segments (the root holds no parameter)

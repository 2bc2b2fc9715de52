"""autopar.api's default cluster: the GPU this job runs on, as a preset."""

import pytest
import torch

from autopar.api import default_cluster
from autopar.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    def install(name: str, count: int = 8) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return install


@pytest.mark.parametrize("name, preset", [("NVIDIA B200", "dgx-b200"), ("NVIDIA H200", "hgx-h200"),
                                          ("NVIDIA H100 80GB HBM3", "dgx-h100"),
                                          ("NVIDIA A100-SXM4-80GB", "dgx-a100-80g")])
def test_a_known_gpu_names_its_preset(gpus, name, preset):
    gpus(name)
    assert default_cluster(16) == f"{preset}:nodes=2,gpus_per_node=8"


def test_a_gpu_without_a_preset_is_refused_with_what_to_pass(gpus):
    gpus("NVIDIA GB200")  # a GB200's NVLink domain is not a DGX B200 node's
    with pytest.raises(ConfigError, match="no cluster preset matches GPU 'NVIDIA GB200'"):
        default_cluster(8)


def test_without_cuda_the_job_plans_for_this_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_cluster(4) == "cpu:procs=4"

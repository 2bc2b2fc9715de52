"""autograd's sums of a tensor's gradients over its uses (autopar/capture/gradient_sums.py)."""

import torch
from torch import nn

from autopar import api
from autopar.capture.export import capture
from autopar.capture.gradient_sums import GRADIENT_SUM_KERNEL
from autopar.capture.probe import KernelRecorder

_ADDS = ("aten.add.Tensor", "aten.add_.Tensor")


class _Block(nn.Module):
    """x feeds the norm and the residual; the norm's output feeds three projections; x * x
    reads one tensor twice."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        y = self.q(h) * self.k(h) + self.v(h)
        return x + y * y


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _graph_adds(graph) -> int:
    return sum(kernel.name in _ADDS for node in graph.calls() for kernel in node.bwd_kernels)


def _autograd_adds(model: nn.Module, x: torch.Tensor) -> int:
    out = model(x)
    with KernelRecorder() as recorder:
        out.backward(torch.ones_like(out))
    return sum(kernel.name in _ADDS for kernel in recorder.kernels)


def test_the_graph_prices_the_additions_autograd_runs():
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 5, 16)
    graph = capture(model, (x,), dynamic_batch=False)
    # per block: x (norm, residual) 1, h (q, k, v) 2, y (y * y) 1; the first layer's input has one use
    assert sum(kernel.name == GRADIENT_SUM_KERNEL for node in graph.calls() for kernel in node.bwd_kernels) >= 12
    assert _graph_adds(graph) == _autograd_adds(model, x)


def test_a_sum_is_priced_at_the_size_of_the_summed_gradient():
    graph = capture(_Block(), (torch.randn(2, 5, 16),), dynamic_batch=False)
    norm = next(node for node in graph.calls() if "layer_norm" in node.target)
    sums = [kernel for kernel in norm.bwd_kernels if kernel.name == GRADIENT_SUM_KERNEL]
    assert len(sums) == 2  # three projections read the norm's output
    assert all(kernel.io_bytes == 3 * norm.output.nbytes and kernel.flops == norm.output.numel for kernel in sums)


def test_repeated_blocks_carry_the_same_sums_and_block_reuse_gives_the_full_graph():
    spec = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,seq=32,vocab=128"
    full = api.capture_for_planning(spec, reuse_blocks=False, cache=False)
    reused = api.capture_for_planning(spec, reuse_blocks=True, cache=False)
    per_block = []
    for segment in full.segments:
        if segment.block_group is not None:
            per_block.append(sum(kernel.name == GRADIENT_SUM_KERNEL for name in segment.nodes
                                 for kernel in full[name].bwd_kernels))
    # x (norm, residual) 1, normed x (q, k, v) 2, h (norm, residual) 1, normed h (gate, up) 1,
    # and rotary q and k (x * cos and the two halves rotate-half slices) 2 each
    assert per_block == [9] * 4
    assert [(node.name, node.bwd_kernels) for node in reused.calls()] == \
        [(node.name, node.bwd_kernels) for node in full.calls()]

"""codegen/runtime.py: a program traced on meta makes and moves its tensors on this rank's device."""

from __future__ import annotations

import torch

from autopar.codegen.runtime import factories_on


def test_meta_devices_of_a_traced_program_become_this_ranks():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ops.aten.ones.default, ([4],), {"device": torch.device("meta")})
    moved = graph.call_function(torch.ops.aten.to.device, (x, torch.device("meta"), torch.float32))
    kept = graph.call_function(torch.ops.aten.to.device, (x, torch.device("cpu"), torch.float32))
    graph.output((ones, moved, kept))
    here = torch.device("cpu")
    factories_on(graph, here)
    assert ones.kwargs["device"] == here and moved.args[1] == here and kept.args[1] == here
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    outputs = module(torch.zeros(4, dtype=torch.bfloat16))
    assert all(not output.is_meta for output in outputs)
    assert outputs[1].dtype == torch.float32

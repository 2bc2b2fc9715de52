"""codegen/recompute.py's region helpers for "modules:<kinds>": which fx nodes a region covers and
which nodes the policy keeps, as solver/recompute_modules.py decides them."""

from types import SimpleNamespace

import autopar
from autopar.codegen.recompute import checkpoint_regions, checkpointed, kept_nodes, region_nodes
from autopar.models import build_model
from autopar.solver.recompute import op_saved_nodes


def _nodes(*names):
    return [SimpleNamespace(name=name) for name in names]


def test_a_region_covers_the_helper_nodes_between_its_ends():
    nodes = _nodes("a", "norm", "size_helper", "linear", "b", "silu", "c")
    assert region_nodes(nodes, [("norm", "linear"), ("silu",)]) == {"norm", "size_helper", "linear", "silu"}
    assert region_nodes(nodes, []) is None


def test_modules_modes_checkpoint_regions_not_whole_segments():
    bundle = build_model("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64", device="meta",
                         batch_size=2)
    graph = autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                         example_targets=bundle.example_targets)
    mode = "modules:layernorm,core_attn"
    assert not checkpointed(mode) and checkpointed("op") and checkpointed("full")
    regions = checkpoint_regions(graph, mode)
    assert regions and all(regions)
    inside = {name for region in regions for name in region}
    kept = kept_nodes(graph, mode)
    assert kept <= inside  # the policy only sees the regions' nodes
    assert any(graph[name].target == "aten.scaled_dot_product_attention.default" for name in inside - kept)
    assert checkpoint_regions(graph, "op") == [] and kept_nodes(graph, "op") == op_saved_nodes(graph)


def _grads(recompute: str):
    import copy

    import torch

    torch.manual_seed(0)
    bundle = build_model("llama:layers=3,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64", device="cpu",
                         batch_size=2)
    plan = autopar.evaluate(copy.deepcopy(bundle.model), bundle.example_inputs, "cpu:procs=1", global_batch=2,
                            loss_fn=bundle.loss_fn, example_targets=bundle.example_targets, recompute=recompute,
                            precision="fp32")
    pm = autopar.parallelize(bundle.model, "cpu:procs=1", bundle.example_inputs, plan=plan, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets)
    loss = pm.train_step(bundle.example_inputs, bundle.example_targets)
    modes = {segment.segment_name: segment.recompute for stage in pm.stages for segment in stage.segments}
    return loss.item(), {name: p.grad.clone() for name, p in pm.named_parameters()}, modes


def test_blocks_mode_checkpoints_the_first_blocks_and_trains_as_without(one_process_group):
    """"blocks:2" runs the first two of the three blocks under "full" and the rest under "none"
    (solver/recompute_blocks.py), with the gradients of the run that recomputes nothing."""
    import torch

    loss, grads, modes = _grads("none")
    blocks_loss, blocks_grads, blocks_modes = _grads("blocks:2")
    assert set(modes.values()) == {"none"}
    assert list(blocks_modes.values()).count("full") == 2
    bundle = build_model("llama:layers=3,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64", device="meta",
                         batch_size=2)
    graph = autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                         example_targets=bundle.example_targets)
    blocks = [segment.name for segment in graph.segments if segment.block_group is not None]
    assert len(blocks) == 3
    assert [name for name, mode in blocks_modes.items() if mode == "full"] == blocks[:2]  # the first two blocks
    assert blocks_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(blocks_grads[name], grad, rtol=0, atol=0, msg=name)

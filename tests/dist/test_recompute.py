"""Re-gathering saves (codegen/recompute.py) on 2 gloo processes: a tensor the interpreter
all-gathered from its sequence shard and two matmuls saved is kept as the shard, gathered again
once in backward, and the gradients equal those of keeping it whole. (The tiny models of
test_numerics plan all-reduces, not sequence parallelism, so nothing is gathered there.)"""

from contextlib import nullcontext

from harness import run_workers


def regather_worker() -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.codegen import recompute
    from autopar.codegen.interpreter import PlannedInterpreter

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, weights = torch.randn(2, 8, 16), [torch.randn(12, 16), torch.randn(6, 16)]
    gathers = []
    original_take = recompute._Gathered.take

    def counting_take(self):
        if self.full is None:
            gathers.append(1)
        return original_take(self)

    recompute._Gathered.take = counting_take

    def run(hooked: bool):
        interpreter = PlannedInterpreter({}, mesh)
        shard = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        params = [distribute_tensor(w, mesh, [Shard(0)]).requires_grad_() for w in weights]
        with recompute.compact_saves(interpreter, regather=True) if hooked else nullcontext():
            gathered = interpreter.place(shard * 2, "R")
            outputs = [torch.nn.functional.linear(gathered, w) for w in params]
        loss = sum((out.redistribute(mesh, [Replicate()]).to_local() ** 2).sum() for out in outputs)
        loss.backward()
        return [t.grad.full_tensor() for t in (shard, *params)], dict(interpreter.stats.kept)

    plain, _ = run(False)
    hooked, kept = run(True)
    return dict(max_error=max((a - b).abs().max().item() for a, b in zip(plain, hooked)), kept=kept,
                gathers_in_backward=len(gathers))


def test_gathered_saves_are_kept_as_shards_and_gathered_once():
    for result in run_workers(regather_worker, world_size=2):
        assert result["kept"].get("regathered") == 2, result  # both matmuls saved the token
        assert result["gathers_in_backward"] == 1, result
        assert result["max_error"] <= 1e-5, result


def activation_worker() -> dict:
    """A column-parallel SwiGLU on DTensors: the product saves silu's output as a recipe."""
    import gc
    import weakref

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.codegen import recompute
    from autopar.codegen.interpreter import PlannedInterpreter

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, gate_w, up_w = torch.randn(2, 8, 16), torch.randn(24, 16), torch.randn(24, 16)
    silu = torch.ops.aten.silu.default
    node = type("Node", (), {"name": "silu", "target": silu})()

    def run(hooked: bool):
        interpreter = PlannedInterpreter({}, mesh)
        interpreter.recomputed_activations = frozenset({"silu"} if hooked else ())
        inputs = distribute_tensor(x, mesh, [Replicate()])
        params = [distribute_tensor(w, mesh, [Shard(0)]).requires_grad_() for w in (gate_w, up_w)]
        with recompute.compact_saves(interpreter, regather=False):
            gate = torch.nn.functional.linear(inputs, params[0])
            gated = silu(gate)
            if interpreter.on_activation is not None:
                interpreter.on_activation(node, (gate,), {}, gated)
            product = gated * torch.nn.functional.linear(inputs, params[1])
        alive = weakref.ref(gated)
        del gated
        gc.collect()
        freed = alive() is None
        (product.redistribute(mesh, [Replicate()]).to_local() ** 2).sum().backward()
        return [p.grad.full_tensor() for p in params], freed, dict(interpreter.stats.kept)

    plain, plain_freed, _ = run(False)
    hooked, hooked_freed, kept = run(True)
    return dict(max_error=max((a - b).abs().max().item() for a, b in zip(plain, hooked)), kept=kept,
                plain_freed=plain_freed, hooked_freed=hooked_freed)


def test_gated_activation_is_saved_as_a_recipe_on_dtensors():
    for result in run_workers(activation_worker, world_size=2):
        assert result["kept"].get("recomputed_activation") == 1, result
        assert result["hooked_freed"] and not result["plain_freed"], result
        assert result["max_error"] == 0.0, result


def pipelined_blocks_worker() -> dict:
    """A fixed pp=2 plan (no stage runs lighter) in "blocks:1" against the same plan in "none"."""
    import copy

    import torch

    import autopar
    from autopar.models import build_model

    def run(mode: str):
        torch.manual_seed(0)
        bundle = build_model("llama:layers=4,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64", device="cpu",
                             batch_size=4)
        plan = autopar.evaluate(copy.deepcopy(bundle.model), bundle.example_inputs, "cpu:procs=2", global_batch=4,
                                microbatch_size=2, pp=2, tp=1, recompute=mode, pipeline_split="uniform",
                                schedule="gpipe", loss_fn=bundle.loss_fn, example_targets=bundle.example_targets,
                                precision="fp32")
        module = autopar.parallelize(bundle.model, "cpu:procs=2", bundle.example_inputs, plan=plan,
                                     loss_fn=bundle.loss_fn, example_targets=bundle.example_targets)
        loss = module.train_step(bundle.example_inputs, bundle.example_targets).item()
        modes = [segment.recompute for stage in module.stages for segment in stage.segments]
        return loss, modes, {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}

    plain, blocks = run("none"), run("blocks:1")
    return dict(losses=(plain[0], blocks[0]), modes=blocks[1],
                max_error=max((plain[2][name] - blocks[2][name]).abs().max().item() for name in plain[2]))


def test_each_pipeline_chunk_checkpoints_its_first_block_and_trains_as_without():
    """"blocks:1" on two chunks of two blocks (solver/recompute_blocks.py): each rank runs its
    chunk's first block under "full", the rest under "none", with the gradients of "none"."""
    for result in run_workers(pipelined_blocks_worker, world_size=2):
        assert result["modes"].count("full") == 1 and result["modes"].count("none") == 2, result
        assert result["losses"][0] == result["losses"][1] and result["max_error"] == 0.0, result

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

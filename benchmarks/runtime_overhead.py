"""Runtime overhead of autopar's module against the same placements written by hand (issue 6).

    .venv/bin/python benchmarks/runtime_overhead.py [--steps 10] [--warmup 3] [--markdown]

Four gloo processes on this machine train the built-in GPT (4 layers, hidden 256, seq 128, global
batch 8; compute dominates) two ways in the same job, step for step alternately:
  - autopar: `autopar.parallelize` with the plan it makes for 4 A100s under fixed constraints;
  - by hand: the same placements with PyTorch's own APIs, as torchtitan writes them:
      tp x dp  `parallelize_module` (ColwiseParallel on q/k/v and fc_in, RowwiseParallel on fc_out;
               o_proj as the plan places it) + FSDP2 `fully_shard` per block (the last one not
               resharded after forward) and at the root (embeddings, final norm, head);
      pp x dp  two `PipelineStage`s cut where the plan cuts, `Schedule1F1B`, gradients all-reduced
               over dp and the tied embedding's two copies over pp, as autopar does.
A step is forward + backward of the global batch, gradient synchronisation, the loss averaged
over dp, and an SGD step. Its wall time is the slowest rank's; its CPU time is the sum over the
ranks of their processes' CPU time (the work done, which other jobs on a shared machine disturb
much less than the wall time). The table gives medians over the steps after warm-up. Both sides
start from the same weights and report their losses, which must agree.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODEL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=256,dropout=0.0"
GLOBAL_BATCH = 8
WORLD_SIZE = 4
CLUSTER = "dgx-a100-80g:gpus_per_node=4"
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Config:
    label: str
    constraints: dict = field(default_factory=dict)


CONFIGS = (
    Config("tp=2 x dp=2, ZeRO-3", {"tp": 2, "dp": 2, "pp": 1, "zero_stage": 3, "microbatch_size": 4}),
    Config("pp=2 x dp=2, 1F1B, 2 microbatches", {"tp": 1, "dp": 2, "pp": 2, "zero_stage": 0, "microbatch_size": 2,
                                                "schedule": "1f1b"}),
)


def build_gpt():
    from autopar.models import build_model

    return build_model(MODEL, device="cpu", seed=0, batch_size=GLOBAL_BATCH)


# --- hand-written tensor parallel + FSDP2 --------------------------------------------------------

class HandTensorParallel:
    """GPT with parallelize_module on the tp axis and fully_shard on the dp axis."""

    def __init__(self, plan, mesh) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       parallelize_module)

        bundle = build_gpt()
        self.model, self.loss_fn, self.mesh = bundle.model, bundle.loss_fn, mesh
        tp = mesh["tp"].size()
        for index, block in enumerate(self.model.layers):
            o_proj = plan.param_placements.get(f"layers.{index}.attn.o_proj.weight", "R")
            layout = {
                # One DTensor input for q, k and v: their input gradients are summed before the
                # single all-reduce, as autopar's graph does (separate inputs would all-reduce 3x).
                "attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel() if o_proj == "S1" else PrepareModuleInput(
                    input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),), use_local_output=True),
                "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(),
            }
            parallelize_module(block, mesh["tp"], layout)
            block.attn.num_heads //= tp  # each rank runs its heads on local tensors
        last = len(self.model.layers) - 1
        for index, block in enumerate(self.model.layers):  # torchtitan keeps the last block gathered
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=index < last)
        fully_shard(self.model, mesh=mesh["dp"], reshard_after_forward=True)

    def parameters(self):
        return self.model.parameters()

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dp, share = self.mesh["dp"].size(), tokens.shape[0] // self.mesh["dp"].size()
        start = self.mesh["dp"].get_local_rank() * share
        loss = self.loss_fn(self.model(tokens[start:start + share]), targets[start:start + share])
        loss.backward()
        return _mean(loss.detach(), self.mesh["dp"].get_group(), dp)


def check_tensor_parallel_plan(plan) -> None:
    """The hand-written layout assumes Megatron's column/row split; stop if the plan differs."""
    for name, placement in plan.param_placements.items():
        if not name.startswith("layers."):
            assert placement == "R", f"{name}: {placement} (the hand-written version replicates it)"
            continue
        expected = {"q_proj.weight": ("S0",), "k_proj.weight": ("S0",), "v_proj.weight": ("S0",),
                    "fc_in.weight": ("S0",), "fc_out.weight": ("S1",), "o_proj.weight": ("R", "S1")}
        suffix = ".".join(name.split(".")[-2:])
        if suffix in expected:
            assert placement in expected[suffix], f"{name}: plan {placement}, hand-written {expected[suffix]}"


# --- hand-written pipeline ---------------------------------------------------------------------------

class FirstStage(nn.Module):
    def __init__(self, gpt, blocks: range) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.layers = nn.ModuleList(gpt.layers[index] for index in blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.layers:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, gpt, blocks: range) -> None:
        super().__init__()
        self.layers = nn.ModuleList(gpt.layers[index] for index in blocks)
        self.ln_f = gpt.ln_f
        self.head = nn.Parameter(gpt.wte.weight.detach().clone())  # the tied embedding's copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return F.linear(self.ln_f(x), self.head)


class HandPipeline:
    """Two PipelineStages with Schedule1F1B; dp gradient and tied-weight all-reduces after the step."""

    def __init__(self, plan, mesh) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        bundle = build_gpt()
        config = bundle.config
        self.mesh, self.pp_rank = mesh, mesh["pp"].get_local_rank()
        cut = plan.stages[0].layers[1]
        blocks = range(0, cut) if self.pp_rank == 0 else range(cut, config.layers)
        self.module = (FirstStage if self.pp_rank == 0 else LastStage)(bundle.model, blocks)
        microbatch = plan.microbatch_size
        # Gradients cross between stages only for examples that require one.
        hidden = torch.empty(microbatch, config.seq, config.hidden, requires_grad=True)
        example_in = torch.zeros(microbatch, config.seq, dtype=torch.long) if self.pp_rank == 0 else hidden
        example_out = hidden if self.pp_rank == 0 else torch.empty(microbatch, config.seq, config.vocab,
                                                                    requires_grad=True)
        stage = PipelineStage(self.module, self.pp_rank, 2, torch.device("cpu"), input_args=(example_in,),
                              output_args=example_out, group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, plan.num_microbatches, loss_fn=bundle.loss_fn)
        self.tied = self.module.wte.weight if self.pp_rank == 0 else self.module.head

    def parameters(self):
        return self.module.parameters()

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dp_mesh = self.mesh["dp"]
        dp, share = dp_mesh.size(), tokens.shape[0] // dp_mesh.size()
        start = dp_mesh.get_local_rank() * share
        losses: list[torch.Tensor] = []
        if self.pp_rank == 0:
            self.schedule.step(tokens[start:start + share])
        else:
            self.schedule.step(target=targets[start:start + share], losses=losses)
        for param in self.module.parameters():
            dist.all_reduce(param.grad, group=dp_mesh.get_group())
            param.grad.div_(dp)
        dist.all_reduce(self.tied.grad, group=self.mesh["pp"].get_group())
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        pp_group = self.mesh["pp"].get_group()
        dist.broadcast(loss, src=dist.get_global_rank(pp_group, 1), group=pp_group)
        return _mean(loss, dp_mesh.get_group(), dp)


def _mean(loss: torch.Tensor, group, size: int) -> torch.Tensor:
    loss = loss.clone()
    dist.all_reduce(loss, group=group)
    return loss / size


# --- the measurement -------------------------------------------------------------------------------

class AutoparSide:
    def __init__(self, config: Config) -> None:
        import autopar

        bundle = build_gpt()
        self.module = autopar.parallelize(bundle.model, CLUSTER, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                          example_targets=bundle.example_targets, constraints=config.constraints)

    def parameters(self):
        return self.module.parameters()

    def step(self, tokens, targets):
        return self.module.train_step((tokens,), targets)


def _timed_step(side, optimizer, tokens, targets) -> tuple[float, float, float]:
    dist.barrier()
    started, started_cpu = time.perf_counter(), time.process_time()
    loss = side.step(tokens, targets)
    optimizer.step()
    optimizer.zero_grad()
    wall = torch.tensor(time.perf_counter() - started)
    cpu = torch.tensor(time.process_time() - started_cpu)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's time is the step's
    dist.all_reduce(cpu)
    return wall.item(), cpu.item(), loss.item()


def measure(config: Config, steps: int, warmup: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    autopar_side = AutoparSide(config)
    plan = autopar_side.module.plan
    mesh = init_device_mesh("cpu", (plan.mesh["pp"], plan.mesh["dp"], plan.mesh["tp"]),
                            mesh_dim_names=("pp", "dp", "tp"))
    if plan.mesh["pp"] > 1:
        hand_side = HandPipeline(plan, mesh)
    else:
        check_tensor_parallel_plan(plan)
        hand_side = HandTensorParallel(plan, mesh)
    sides = {"autopar": autopar_side, "hand": hand_side}
    optimizers = {name: torch.optim.SGD(side.parameters(), lr=LEARNING_RATE) for name, side in sides.items()}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu_times: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(warmup + steps):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, 128), generator=generator)
        targets = (tokens + 1) % 256
        order = list(sides) if step % 2 == 0 else list(reversed(sides))  # neither side always runs first
        for name in order:
            wall, cpu, loss = _timed_step(sides[name], optimizers[name], tokens, targets)
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(wall)
                cpu_times[name].append(cpu)
    summary = {f"{name}_{kind}_ms": statistics.median(values[name]) * 1e3
               for name in sides for kind, values in (("wall", times), ("cpu", cpu_times))}
    return dict(label=config.label, plan=_describe(plan), autopar_losses=losses["autopar"], hand_losses=losses["hand"],
                **summary)


def _describe(plan) -> str:
    mesh = plan.mesh
    return (f"pp={mesh['pp']} dp={mesh['dp']} tp={mesh['tp']}, {plan.num_microbatches} x {plan.microbatch_size} "
            f"microbatches, ZeRO-{plan.zero_stage}")


def worker(rank: int, port: int, steps: int, warmup: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for config in CONFIGS:
        result = measure(config, steps, warmup)
        if rank == 0:
            results.put(result)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def print_table(results: list[dict], markdown: bool) -> None:
    rows = []
    for result in results:
        row = [result["label"]]
        for kind in ("wall", "cpu"):
            autopar_ms, hand_ms = result[f"autopar_{kind}_ms"], result[f"hand_{kind}_ms"]
            row += [f"{autopar_ms:.1f}", f"{hand_ms:.1f}", f"{(autopar_ms / hand_ms - 1) * 100:+.1f}%"]
        rows.append(tuple(row))
    header = ("configuration", "autopar ms", "hand-written ms", "overhead", "autopar CPU ms", "hand-written CPU ms",
              "overhead (CPU)")
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(item)) for item in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(item).ljust(width) for item, width in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration and side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(worker, args=(_free_port(), args.steps, args.warmup, queue), nprocs=WORLD_SIZE,
                       start_method="spawn")
    results = [queue.get() for _ in CONFIGS]
    for result in results:
        gap = max(abs(a - h) for a, h in zip(result["autopar_losses"], result["hand_losses"]))
        print(f"{result['label']}: autopar's plan {result['plan']}; largest loss difference autopar vs hand "
              f"{gap:.1e} over {len(result['hand_losses'])} steps")
    print()
    print_table(results, args.markdown)


if __name__ == "__main__":
    main()

"""Fixed tensor-parallel configurations planned with and without the vocabulary-parallel loss.

    .venv/bin/python benchmarks/vocab_parallel_loss.py [--memory]

The same search twice per row: once with cross-entropy's class-sharded strategy removed (every
tp rank gathers the fp32 logits and computes the whole loss, autopar before it had the strategy),
once as shipped. Prints predicted step time, peak memory and whether the plan keeps the logits
sharded (plan.loss_parallel).

`--memory` measures instead what the loss itself holds at its peaks on this machine: the resident
memory (VmHWM, reset through /proc/self/clear_refs) of fresh processes (the most of MEMORY_RUNS)
running cross-entropy on fp32-cast logits of L bytes, forward then backward, with aten's fused
kernels and under DTensor's loss_parallel (a one-rank gloo mesh), beside what the plan prices for
the same loss (the held log-probabilities plus the op's gradient workspace, solver/evaluate.py, at
tp 1 and tp 2).
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
from contextlib import contextmanager, nullcontext

from autopar import api
from autopar.strategies import loss, replicate_all

LLAMA3_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn_hidden=14336,seq=8192,vocab=128256"
LLAMA3_70B = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn_hidden=28672,seq=8192,vocab=128256"
ROWS = (
    ("Llama 3 8B, tp8 on 1 DGX-H100, seq 8192, global batch 8, selective", LLAMA3_8B, "dgx-h100:nodes=1", 8,
     dict(tp=8, dp=1, pp=1, microbatch_size=1, recompute="selective")),
    ("Llama 3 70B, tp8 pp4 1F1B on 4 DGX-H100, seq 8192, global batch 32, selective", LLAMA3_70B,
     "dgx-h100:nodes=4", 32, dict(tp=8, dp=1, pp=4, microbatch_size=1, recompute="selective", schedule="1f1b")),
)


@contextmanager
def without_vocab_parallel_loss():
    original = loss._vocab_parallel
    loss._vocab_parallel = lambda inputs: replicate_all(None, inputs)[0]
    try:
        yield
    finally:
        loss._vocab_parallel = original


def _cell(spec: str, cluster: str, global_batch: int, constraints: dict) -> str:
    plan = api.plan(spec, cluster=cluster, global_batch=global_batch, constraints=constraints)
    predicted = plan.predicted
    return (f"{predicted.step_time_s:.3f} s, {predicted.peak_memory_bytes / 2**30:.1f} GiB, "
            f"loss_parallel={plan.loss_parallel}")


ROWS_TOKENS, LOSS_VOCAB = 4096, 32768
"""The measured loss's logits: fp32 L = 512 MiB."""


def _resident_peak_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _resident_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as status:
        status.write("5")


def measure_loss(parallel: bool) -> tuple[float, float]:
    """(forward, backward) resident peaks of one cross-entropy, in fp32 logits (L), above the
    bf16 logits it starts from; in this process, which must be fresh."""
    import os

    import torch
    import torch.nn.functional as F

    logits = torch.randn(ROWS_TOKENS, LOSS_VOCAB, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, LOSS_VOCAB, (ROWS_TOKENS,))
    context = nullcontext()
    if parallel:
        import torch.distributed as dist
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
        local = logits.detach()
        del logits  # (freed before the baseline is read: the DTensor holds `local`)
        logits = distribute_tensor(local, mesh, [Shard(1)]).requires_grad_()
        del local
        target = distribute_tensor(target, mesh, [Replicate()])
        context = loss_parallel()
    size = ROWS_TOKENS * LOSS_VOCAB * 4
    gc.collect()
    base = _resident_bytes()
    _reset_peak()
    with context:
        loss = F.cross_entropy(logits.float(), target)
        forward = _resident_peak_bytes() - base
        _reset_peak()
        loss.backward()
    return forward / size, (_resident_peak_bytes() - base) / size


def priced_loss_peaks() -> dict[int, float]:
    """The plan's backward peak of the loss, in local fp32 logits, by tp: the log-probabilities
    it keeps (an activation) plus the gradient workspace of the cross-entropy's strategy."""
    from autopar.cluster import Cluster
    from autopar.mesh import Mesh
    from autopar.solver.sharding import solve_sharding

    graph = api.capture_for_planning("gpt:layers=1,hidden=256,heads=4,seq=512,vocab=32768").with_batch(1)
    loss = next(node for node in graph.nodes if node.target == "aten.cross_entropy_loss.default")
    peaks = {}
    for tp in (1, 2):
        mesh = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=8)
        result = solve_sharding(graph, mesh, Cluster.from_spec("dgx-a100-80g"))
        local = graph[loss.inputs[0]].output.numel * 4 / tp
        workspace = max(segment.grad_workspace_bytes for segment in result.segments)
        peaks[tp] = 1 + workspace / local
    return peaks


MEMORY_RUNS = 3
"""Fresh processes per mode; the table keeps each peak's largest reading (a run reads up to 0.5 L
low when a buffer freed after its baseline was still counted in it: resident memory, not tensors)."""


def print_memory() -> None:
    measured = {}
    for mode in ("fused", "loss_parallel"):
        runs = [subprocess.run([sys.executable, __file__, "--measure-loss", mode], capture_output=True, text=True,
                               check=True) for _ in range(MEMORY_RUNS)]
        readings = [[float(value) for value in done.stdout.split()] for done in runs]
        measured[mode] = [max(values) for values in zip(*readings)]
    priced = priced_loss_peaks()
    size_mib = ROWS_TOKENS * LOSS_VOCAB * 4 / 2**20
    print(f"| cross-entropy on fp32 logits (L = {size_mib:.0f} MiB) | measured forward peak | measured backward peak "
          "| priced backward peak |")
    print("|---|---:|---:|---:|")
    for mode, tp in (("fused", 1), ("loss_parallel", 2)):
        forward, backward = measured[mode]
        print(f"| {mode} (the plan's strategy at tp {tp}) | {forward:.2f} L | {backward:.2f} L | {priced[tp]:.2f} L |")


def main() -> int:
    if "--measure-loss" in sys.argv:
        print(*measure_loss(sys.argv[-1] == "loss_parallel"))
        return 0
    if "--memory" in sys.argv:
        print_memory()
        return 0
    print("| configuration | gathered logits | vocabulary-parallel |")
    print("|---|---|---|")
    for label, spec, cluster, global_batch, constraints in ROWS:
        with without_vocab_parallel_loss():
            gathered = _cell(spec, cluster, global_batch, constraints)
        print(f"| {label} | {gathered} | {_cell(spec, cluster, global_batch, constraints)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

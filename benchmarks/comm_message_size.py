"""Achieved collective bandwidth against message size and group span, and what it does to FSDP plans.

    .venv/bin/python benchmarks/comm_message_size.py [--curves] [--plans ids]

`--curves` prints the model's achieved bus bandwidth (nccl-tests convention) and the NCCL way it
picks (ring or tree, LL / LL128 / Simple) for all-gather and all-reduce on the GPU presets, by
message size and group shape: inside a node, across nodes with 8 ranks per node, and with one
rank per node (a dp axis with tp inside the node).

`--plans` evaluates FSDP configurations whose per-block all-gathers are the question (issue 11):
ZeRO-3 data parallelism at dp in the thousands on Megatron SC21 models, and FSDP x TP (2-D) on
Llama 3.1 70B / 405B, printing the step breakdown, the report's FSDP note and, per transformer
block, the all-gather's message, per-rank chunk, group, chosen way, achieved bandwidth and time
against the block's compute. No published numbers are read here.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from autopar import api
from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.solver.search import Planner
from cost_model.comm import CommModel, Group
from cost_model.memory import BF16_ADAM, FSDP2_BF16_FP32_REDUCE, PrecisionPolicy

MIB = 2**20


def curves() -> None:
    sizes = [2**k for k in (16, 20, 23, 26, 28, 30, 32)]
    print("| preset | op | group | " + " | ".join(_size(size) for size in sizes) + " |")
    print("|---|---|---|" + "---:|" * len(sizes))
    for preset in ("dgx-a100-80g", "dgx-h100"):
        model = CommModel(Cluster.from_spec(f"{preset}:nodes=512"))
        groups = [Group(num_nodes=1, devices_per_node=8), Group(num_nodes=2, devices_per_node=8),
                  Group(num_nodes=16, devices_per_node=1), Group(num_nodes=16, devices_per_node=8),
                  Group(num_nodes=192, devices_per_node=8)]
        for op in ("all_gather", "all_reduce"):
            for group in groups:
                cells = [f"{model.bus_bandwidth_bytes_per_s(op, size, group) / 1e9:.0f} "
                         f"{model.choice(op, size, group).name}" for size in sizes]
                print(f"| {preset} | {op} | {group.num_nodes}x{group.devices_per_node} | " + " | ".join(cells) + " |")


def _size(size: float) -> str:
    return f"{size / MIB:g} MiB" if size < 2**30 else f"{size / 2**30:g} GiB"


@dataclass(frozen=True, kw_only=True)
class Case:
    """One FSDP configuration to evaluate."""

    id: str
    model: str
    cluster: str
    global_batch: int
    tp: int
    dp: int
    microbatch: int
    recompute: str
    policy: PrecisionPolicy
    block_params: float
    """Parameters of one transformer block (the FSDP unit that dominates)."""


def _gpt_block(hidden: int) -> float:
    return 12 * hidden * hidden


def _llama_block(hidden: int, heads: int, kv_heads: int, ffn: int) -> float:
    head_dim = hidden // heads
    return 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn


LLAMA_405B = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,vocab=128256,seq=8192"
LLAMA_70B = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn_hidden=28672,vocab=128256,seq=8192"
CASES = (
    Case(id="gpt-175b-zero3-dp1536", model="gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
         cluster="dgx-a100-80g:nodes=192", global_batch=1536, tp=1, dp=1536, microbatch=1, recompute="full",
         policy=BF16_ADAM, block_params=_gpt_block(12288)),
    Case(id="gpt-1t-zero3-dp3072", model="gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200",
         cluster="dgx-a100-80g:nodes=384", global_batch=3072, tp=1, dp=3072, microbatch=1, recompute="full",
         policy=BF16_ADAM, block_params=_gpt_block(25600)),
    Case(id="llama-405b-fsdp16-tp8", model=LLAMA_405B, cluster="dgx-h100:nodes=16", global_batch=32, tp=8, dp=16,
         microbatch=2, recompute="full", policy=FSDP2_BF16_FP32_REDUCE,
         block_params=_llama_block(16384, 128, 8, 53248)),
    Case(id="llama-70b-fsdp32-tp8", model=LLAMA_70B, cluster="dgx-h100:nodes=32", global_batch=512, tp=8, dp=32,
         microbatch=2, recompute="full", policy=FSDP2_BF16_FP32_REDUCE,
         block_params=_llama_block(8192, 64, 8, 28672)),
)


def evaluate(case: Case, *, detail: bool = True) -> None:
    """Evaluate one case; `detail` adds the per-block collectives (the protocol model's view)."""
    started = time.perf_counter()
    cluster = Cluster.from_spec(case.cluster)
    graph = api.capture_for_planning(case.model, precision="bf16")
    planner = Planner(graph, cluster, global_batch=case.global_batch, policy=case.policy, precision="bf16")
    config = api.fixed_config(planner, tp=case.tp, pp=1, dp=case.dp, microbatch_size=case.microbatch,
                              schedule="1f1b", virtual_stages=None, layers_per_virtual_stage=None,
                              recompute=case.recompute, zero_stage=3)
    estimate, _ = planner.evaluate(config)
    parts = ", ".join(f"{name} {seconds:.4g}" for name, seconds in estimate.breakdown_s.items() if seconds)
    print(f"\n### {case.id}: {config.describe()} on {case.cluster} ({time.perf_counter() - started:.0f} s)")
    print(f"step {estimate.step_time_s:.4g} s: {parts}; peak {estimate.peak_memory_bytes / 2**30:.1f} GiB, "
          f"{'fits' if estimate.fits else 'does NOT fit'}")
    for note in estimate.notes:
        print(f"note: {note}")
    if not detail:
        return
    stage = estimate.stages[0]
    group = Mesh(axis_names=("pp", "dp_cp", "tp"), shape=(1, config.data_shards, config.tp),
                 devices_per_node=cluster.devices_per_node).group(1)
    comm = CommModel(cluster)
    units = len(stage.segment_names)
    block_compute_s = (stage.forward_s + stage.backward_s + stage.recompute_s) / max(units, 1)
    for op, dtype_bytes in (("all_gather", case.policy.fsdp_gather_bytes), ("reduce_scatter", case.policy.dp_reduce_bytes)):
        message = case.block_params / case.tp * dtype_bytes
        way = comm.choice(op, message, group)
        seconds = comm.time_s(op, message, group)
        print(f"per block {op}: {message / MIB:.1f} MiB over {group.num_nodes} nodes x {group.devices_per_node} "
              f"(chunk {message / group.num_devices / MIB:.2f} MiB per rank), {way.name}, "
              f"{comm.bus_bandwidth_bytes_per_s(op, message, group) / 1e9:.0f} GB/s bus, {seconds * 1e3:.2f} ms "
              f"(latency {way.latency_s * 1e3:.2f} ms) against {block_compute_s * 1e3:.1f} ms of a block's "
              f"compute per microbatch (mean over {units} units)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", action="store_true", help="print achieved bandwidth by size and group")
    parser.add_argument("--plans", nargs="?", const="all", help="evaluate FSDP cases (comma-separated ids or all)")
    args = parser.parse_args()
    if not args.curves and not args.plans:
        args.curves, args.plans = True, "all"
    if args.curves:
        curves()
    if args.plans:
        wanted = None if args.plans == "all" else set(args.plans.split(","))
        for case in CASES:
            if wanted is None or case.id in wanted:
                evaluate(case)
    return 0


if __name__ == "__main__":
    sys.exit(main())

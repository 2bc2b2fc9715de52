"""One device, one model: autopar's predicted step time and peak memory against a measured step.

    .venv/bin/python benchmarks/one_device_step.py --model gpt3-1.3b --global-batch 8 \
        --cluster hgx-h200:nodes=1,gpus_per_node=1,profile=benchmarks/profiles/h200.json --markdown

The check the developers' guide asks of a lent GPU (after `autopar profile --device cuda --quick
--out benchmarks/profiles/h200.json`): the model is built with real weights on the device, planned
for that one-device cluster by `autopar.parallelize` (the planner picks microbatching and
recomputation), and trained with AdamW for `--warmup` + `--steps` steps (forward, backward,
optimizer step, synchronised). It prints predicted against measured step time, model FLOP/s and
MFU (model FLOPs of the step, recomputation not counted, over the device's peak for the precision),
and peak memory (allocated and reserved by the caching allocator) against the prediction, with
the plan's memory breakdown. On a machine without a GPU it runs on the CPU (use a small model:
`--model gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128 --cluster cpu:procs=1`), which checks the
script, not the cost model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

GIB = 2**30


def measure(model_spec: str, cluster: str, global_batch: int, precision: str, warmup: int, steps: int) -> dict:
    import autopar
    from autopar.cluster import Cluster
    from autopar.models import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundle = build_model(model_spec, device=device, seed=0, batch_size=global_batch)
    pm = autopar.parallelize(bundle.model, cluster, tuple(bundle.example_inputs), loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets, precision=precision)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times_s = []
    for step in range(warmup + steps):
        _synchronize(device)
        started = time.perf_counter()
        pm.train_step(tuple(bundle.example_inputs), bundle.example_targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        if step >= warmup:
            times_s.append(time.perf_counter() - started)
    plan = pm.plan
    peak_flops = Cluster.from_spec(cluster).device.peak_flops_per_s.get(_dtype(precision), 0.0)
    measured_s = statistics.median(times_s)
    return dict(plan=plan, measured_s=measured_s, times_s=times_s, peak_flops=peak_flops, device=device,
                device_name=torch.cuda.get_device_name() if device == "cuda" else "CPU",
                allocated_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                reserved_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _dtype(precision: str) -> str:
    return {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(precision, "bf16")


def report(result: dict, model_spec: str, global_batch: int) -> str:
    plan, measured_s = result["plan"], result["measured_s"]
    predicted_s = plan.predicted.step_time_s
    flops = plan.predicted.model_flops_per_step
    from autopar.tune.trials import describe

    lines = [f"{model_spec}, global batch {global_batch}, on {result['device_name']}: {describe(plan)}", "",
             "| quantity | predicted | measured | error |", "|---|---:|---:|---:|",
             f"| step time (ms) | {predicted_s * 1e3:.1f} | {measured_s * 1e3:.1f} | "
             f"{100 * (predicted_s / measured_s - 1):+.1f}% |"]
    if result["peak_flops"]:
        predicted_mfu, measured_mfu = (flops / predicted_s / result["peak_flops"], flops / measured_s / result["peak_flops"])
        lines.append(f"| MFU | {100 * predicted_mfu:.1f}% | {100 * measured_mfu:.1f}% | |")
    lines.append(f"| model TFLOP/s | {flops / predicted_s / 1e12:.3g} | {flops / measured_s / 1e12:.3g} | |")
    predicted_gib = plan.predicted.peak_memory_bytes / GIB
    if result["reserved_bytes"] is not None:
        reserved_gib, allocated_gib = result["reserved_bytes"] / GIB, result["allocated_bytes"] / GIB
        lines.append(f"| peak memory, reserved (GiB) | {predicted_gib:.2f} | {reserved_gib:.2f} | "
                     f"{100 * (predicted_gib / reserved_gib - 1):+.1f}% |")
        lines.append(f"| peak memory, allocated (GiB) | | {allocated_gib:.2f} | |")
    else:
        lines.append(f"| peak memory (GiB) | {predicted_gib:.2f} | not measured on CPU | |")
    lines += ["", "step times (ms): " + ", ".join(f"{t * 1e3:.1f}" for t in result["times_s"]),
              "predicted memory (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.predicted.memory_bytes.items()),
              "predicted time (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in plan.predicted.breakdown_s.items())]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--cluster", default="hgx-h200:nodes=1,gpus_per_node=1")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--precision", default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--markdown", action="store_true", help="(the table is markdown either way)")
    args = parser.parse_args()
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    result = measure(args.model, args.cluster, args.global_batch, precision, args.warmup, args.steps)
    print(report(result, args.model, args.global_batch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

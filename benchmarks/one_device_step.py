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


def measure(model_spec: str, cluster: str, global_batch: int, precision: str, warmup: int, steps: int,
            kernels_out: str | None = None, optimizer: str = "foreach") -> dict:
    import autopar
    from autopar.cluster import Cluster
    from autopar.solver.search import SearchOptions
    from autopar.models import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundle = build_model(model_spec, device=device, seed=0, batch_size=global_batch)
    planning_started = time.perf_counter()
    pm = autopar.parallelize(bundle.model, cluster, tuple(bundle.example_inputs), loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets, precision=precision,
                             options=SearchOptions(optimizer=optimizer))
    planning_s = time.perf_counter() - planning_started
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=optimizer == "fused" or None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def one_step() -> None:
        pm.train_step(tuple(bundle.example_inputs), bundle.example_targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times_s = []
    for step in range(warmup + steps):
        _synchronize(device)
        started = time.perf_counter()
        one_step()
        _synchronize(device)
        if step >= warmup:
            times_s.append(time.perf_counter() - started)
    kernels = kernel_times(one_step, kernels_out) if kernels_out and device == "cuda" else None
    plan = pm.plan
    peak_flops = Cluster.from_spec(cluster).device.peak_flops_per_s.get(_dtype(precision), 0.0)
    measured_s = statistics.median(times_s)
    return dict(plan=plan, measured_s=measured_s, planning_s=planning_s, kernels=kernels, times_s=times_s,
                peak_flops=peak_flops, device=device,
                device_name=torch.cuda.get_device_name() if device == "cuda" else "CPU",
                allocated_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                reserved_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None)


KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
                ("optimizer", ("multi_tensor", "foreach", "adam")),
                ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")))
"""Kernel name fragments (lower case) by kind, first match wins; the rest is "elementwise/other"."""


def kernel_times(one_step, out_path: str) -> dict[str, float]:
    """One more step under torch.profiler: device seconds by kernel kind (and "all"); the per-kernel
    table goes to out_path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        annotation = getattr(event, "is_user_annotation", False) or event.name.startswith(("Optimizer.", "ProfilerStep"))
        if str(event.device_type).endswith("CUDA") and not annotation:
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time * 1e-6
    by_op = sorted(((e.key, e.self_device_time_total * 1e-6) for e in prof.key_averages() if e.key.startswith("aten::")),
                   key=lambda item: -item[1])
    by_kind = {"all": sum(by_kernel.values())}
    for name, seconds in by_kernel.items():
        kind = next((k for k, parts in KERNEL_KINDS if any(p in name.lower() for p in parts)), "elementwise/other")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    with open(out_path, "w") as out:
        for name, seconds in sorted(by_kernel.items(), key=lambda item: -item[1]):
            out.write(f"{seconds * 1e3:10.3f} ms  {name}\n")
        out.write("\n# device time by aten op (self)\n")
        for name, seconds in by_op:
            if seconds > 0:
                out.write(f"{seconds * 1e3:10.3f} ms  {name}\n")
    return by_kind


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
    if result.get("kernels"):
        lines.append("| device (kernel) time in one profiled step (ms) | | "
                     + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result["kernels"].items()) + " | |")
    lines += ["", f"planning (parallelize) took {result['planning_s']:.1f} s",
              "step times (ms): " + ", ".join(f"{t * 1e3:.1f}" for t in result["times_s"]),
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
    parser.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach",
                        help="AdamW as torch runs it by default (foreach) or AdamW(fused=True); priced as such")
    parser.add_argument("--kernels-out", metavar="FILE",
                        help="on a GPU: profile one more step, write device time per kernel to FILE and print it by kind")
    args = parser.parse_args()
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    result = measure(args.model, args.cluster, args.global_batch, precision, args.warmup, args.steps,
                     kernels_out=args.kernels_out, optimizer=args.optimizer)
    print(report(result, args.model, args.global_batch))
    if result["kernels"]:  # the same step by op, predicted beside measured (benchmarks/kernel_kinds.py)
        from benchmarks.kernel_kinds import op_table

        print("\n" + op_table(args.model, args.global_batch, args.cluster, args.kernels_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Predicted device time of one training step by aten op, beside a measured one.

    .venv/bin/python benchmarks/kernel_kinds.py MODEL --global-batch B --cluster SPEC [--kernels FILE]

The prediction is the planner's view of one device running the whole step with no parallelism
(one microbatch of B): every captured kernel, forward and backward, priced by the cost model of
SPEC's device (its profile, if SPEC names one). FILE is what `benchmarks/one_device_step.py
--kernels-out FILE` wrote on a GPU (device time by aten op, measured with torch.profiler); rows
are then matched by op name. Fused attention is one row whatever backend ran it (flash, cuDNN,
efficient), an in-place op is its op's row (`masked_fill_`: `masked_fill`), and casts and copies
are one row (`_to_copy` and `clone` in the capture, `copy_` on the device). The
optimizer step, the once-per-step weight cast and the gradient casts are not graph kernels: the
plan's breakdown prices them (measured, they are the `optimizer` row and part of `copy / cast`).
"""

from __future__ import annotations

import argparse
from collections import Counter

from autopar.api import capture_for_planning
from autopar.cluster import Cluster
from cost_model.compute import ComputeModel, attention_phase

_ALIASES = {"copy": "copy / cast", "_to_copy": "copy / cast", "clone": "copy / cast"}
"""The capture's casts and contiguous copies run as torch's copy_ kernels."""


def row_of(op: str) -> str:
    """One row name for an op of the capture ("aten.mm.default") or of the profiler ("aten::mm")."""
    short = op.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    if "attention" in short:
        return "attention backward" if "backward" in short else "attention forward"
    if short.startswith("_foreach_") or short.startswith("_fused_adam"):
        return "optimizer"
    short = short if short.startswith("_") and not short.endswith("_") else short.rstrip("_")  # in place
    return _ALIASES.get(short, short)


def predicted_ms(model_spec: str, global_batch: int, cluster_spec: str) -> Counter:
    cluster = Cluster.from_spec(cluster_spec)
    compute = ComputeModel(cluster.device, cluster.profile)
    graph = capture_for_planning(model_spec)
    graph = graph.with_batch(global_batch) if graph.batch_dynamic else graph
    rows: Counter = Counter()
    for node in graph.calls():
        for kernel in node.fwd_kernels + node.bwd_kernels:
            name = kernel.name if attention_phase(kernel.name) is None else \
                f"attention {attention_phase(kernel.name)}"
            rows[row_of(name)] += compute.kernels([kernel]).total_s * 1e3
    return rows


def measured_ms(path: str) -> Counter:
    rows: Counter = Counter()
    text = open(path).read()
    section = text.split("# device time by aten op (self)", 1)[-1] if "# device time by aten op" in text else ""
    for line in section.strip().splitlines():
        milliseconds, _, name = line.partition(" ms  ")
        rows[row_of(name.strip())] += float(milliseconds)
    return rows


def op_table(model_spec: str, global_batch: int, cluster_spec: str, kernels_path: str | None = None,
             rows: int = 20) -> str:
    """The markdown table: predicted beside measured milliseconds by op, largest first."""
    predicted = predicted_ms(model_spec, global_batch, cluster_spec)
    measured = measured_ms(kernels_path) if kernels_path else Counter()
    names = sorted(set(predicted) | set(measured), key=lambda row: -max(predicted[row], measured[row]))
    lines = ["| op | predicted ms | measured ms | predicted / measured |", "|---|---:|---:|---:|"]
    for row in names[:rows]:
        ratio = f"{predicted[row] / measured[row]:.2f}" if measured[row] else ""
        lines.append(f"| {row} | {predicted[row]:.1f} | {measured[row]:.1f} | {ratio} |")
    rest_p, rest_m = (sum(values[row] for row in names[rows:]) for values in (predicted, measured))
    lines.append(f"| (the other {max(len(names) - rows, 0)}) | {rest_p:.1f} | {rest_m:.1f} | |")
    in_graph = sum(value for row, value in measured.items() if row != "optimizer")
    total = f"{sum(predicted.values()) / in_graph:.2f}" if in_graph else ""
    lines.append(f"| **all but the optimizer** | {sum(predicted.values()):.1f} | {in_graph:.1f} | {total} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--kernels", help="a --kernels-out file of benchmarks/one_device_step.py")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    print(op_table(args.model, args.global_batch, args.cluster, args.kernels, args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

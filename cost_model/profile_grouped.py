"""`autopar profile`: the grouped-matmul sweep (mixture-of-experts layers).

A grouped matmul `torch._grouped_mm(tokens[E m, K], weight[E, K, N], offs)` runs E experts'
matmuls of m rows each. Its rate depends on the rows one expert gets (m), not on the total: a
layer of 128 experts at 32 rows each runs far below one [128 x 32, K] x [K, N] matmul. The sweep
times E = 8 experts at K = N (the hidden and expert widths of typical MoE layers: 2048 on GPUs,
256 on CPUs) over rows per expert m, per dtype, and records each point by its FLOPs per expert,
which is what ComputeModel.grouped_matmul_s looks the rate up by. A dtype the device's
_grouped_mm does not run (bf16 needs compute capability 9.0 on CUDA) has no points; the
matmul sweep then prices it.
"""

from __future__ import annotations

import torch

from cost_model.profile import GroupedMatmulPoint
from cost_model.profile_options import TORCH_DTYPES
from cost_model.profile_timing import interleaved_medians

EXPERTS = 8
_ROWS = {"cpu": (16, 32, 64, 128, 256), "cuda": (64, 128, 256, 512, 1024, 2048, 4096)}
_ROWS_QUICK = {"cpu": (32, 128), "cuda": (128, 1024, 4096)}
_WIDTH = {"cpu": 256, "cuda": 2048}


def measure_grouped_matmuls(timer, device: torch.device, options, compute_time_s, deadline_s: float
                            ) -> tuple[GroupedMatmulPoint, ...]:
    """The sweep; `compute_time_s(call_s)` turns a measured call into the kernel's time (the
    profiler's rule for CPU dispatch overhead)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    width = _WIDTH[kind]
    cases, keys = [], []
    # torch._grouped_mm takes the plain dtypes; fp8 (torch._scaled_mm's) has no grouped sweep here
    for dtype in (dtype for dtype in options.matmul_dtypes if dtype in TORCH_DTYPES):
        for rows in (_ROWS_QUICK if options.quick else _ROWS)[kind]:
            operands = _operands(rows, width, TORCH_DTYPES[dtype], device)
            if operands is None:
                break  # this dtype does not run grouped on this device
            cases.append(lambda operands=operands: torch._grouped_mm(*operands[:2], offs=operands[2]))
            keys.append((dtype, rows))
    if not cases:
        return ()
    times = interleaved_medians(timer, cases, warmup=options.warmup, repeats=options.repeats,
                                min_sample_s=options.min_sample_s, deadline_s=deadline_s)
    points = []
    for (dtype, rows), call_s in zip(keys, times):
        per_expert = 2.0 * rows * width * width
        points.append(GroupedMatmulPoint(dtype=dtype, experts=EXPERTS, flops_per_expert=per_expert,
                                         achieved_flops_per_s=EXPERTS * per_expert / compute_time_s(call_s)))
    return tuple(sorted(points, key=lambda point: (point.dtype, point.flops_per_expert)))


def _operands(rows: int, width: int, dtype: torch.dtype, device: torch.device):
    """(tokens, weight, offsets) of one case, or None when _grouped_mm refuses the dtype here."""
    tokens = torch.randn(EXPERTS * rows, width, dtype=dtype, device=device)
    weight = torch.randn(EXPERTS, width, width, dtype=dtype, device=device).transpose(-2, -1)
    offsets = torch.arange(1, EXPERTS + 1, dtype=torch.int32, device=device) * rows
    try:
        torch._grouped_mm(tokens, weight, offs=offsets)
    except (RuntimeError, NotImplementedError):
        return None
    return tokens, weight, offsets

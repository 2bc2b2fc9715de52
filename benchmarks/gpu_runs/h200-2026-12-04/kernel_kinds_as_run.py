"""`benchmarks/kernel_kinds.py` for the eager-attention GPT as it ran on this H200 (2026-12-04).

    .venv/bin/python benchmarks/gpu_runs/h200-2026-12-04/kernel_kinds_as_run.py [kernel_kinds.py's arguments]

The built-in GPT's eager attention changed after this run (scale on q and a `where` mask: commit
133695a); the measured kernels are of the earlier one, which scaled the s x s scores and masked
them with `masked_fill`. This puts that attention back for the capture and runs kernel_kinds.py
(default arguments: gpt3-1.3b, global batch 8, the H200 profile, this run's kernels).
"""

from __future__ import annotations

import math
import os
import runpy
import sys
from pathlib import Path

import torch

from autopar.models.gpt import SelfAttention

HERE = Path(__file__).resolve().parent
DEFAULTS = ["gpt3-1.3b", "--global-batch", "8",
            "--cluster", "hgx-h200:nodes=1,gpus_per_node=1,profile=benchmarks/profiles/h200.json",
            "--kernels", str(HERE / "kernels-gpt3-1.3b.txt")]


def _eager_attention_as_run(self, query, key, value):
    scores = query @ key.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))
    if self.causal:
        seq_len = query.shape[-2]
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return self.attn_dropout(scores.softmax(dim=-1)) @ value


if __name__ == "__main__":
    os.environ["AUTOPAR_CAPTURE_CACHE"] = "0"  # the cache keys on the code, not on this patch
    SelfAttention._eager_attention = _eager_attention_as_run
    sys.argv = [str(HERE.parents[1] / "kernel_kinds.py"), *(sys.argv[1:] or DEFAULTS)]
    runpy.run_path(sys.argv[0], run_name="__main__")

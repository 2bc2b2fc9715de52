"""Fixed tensor-parallel configurations planned with and without the vocabulary-parallel loss.

    .venv/bin/python benchmarks/vocab_parallel_loss.py

The same search twice per row: once with cross-entropy's class-sharded strategy removed (every
tp rank gathers the fp32 logits and computes the whole loss, autopar before it had the strategy),
once as shipped. Prints predicted step time, peak memory and whether the plan keeps the logits
sharded (plan.loss_parallel).
"""

from __future__ import annotations

from contextlib import contextmanager

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


def main() -> int:
    print("| configuration | gathered logits | vocabulary-parallel |")
    print("|---|---|---|")
    for label, spec, cluster, global_batch, constraints in ROWS:
        with without_vocab_parallel_loss():
            gathered = _cell(spec, cluster, global_batch, constraints)
        print(f"| {label} | {gathered} | {_cell(spec, cluster, global_batch, constraints)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

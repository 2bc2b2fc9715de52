"""Pipeline sends and receives overlapped with compute, for runtimes that run them so
(PrecisionPolicy.p2p_overlap: Megatron-Core's `overlap_p2p_comm`; torch.distributed.pipelining's
interleaved schedule, whose runtime posts receives early and waits on sends at the step's end).

In the interleaved schedule a rank runs one model chunk after another, and each chunk's output
goes to the next pipeline rank (its gradient comes back in the backward). With
`overlap_p2p_comm` Megatron-Core posts the send of a chunk's output and the receive of the next
chunk's input as asynchronous operations and waits on them only when that input is needed, so in
the steady state (1F1B: a forward of one chunk beside a backward of another) every transfer runs
while another chunk computes. NeMo's documentation ("Communication Overlap", pipeline-parallel
section): "NeMo supports the overlap of the PP communications with non-dependant computations in
the 1F1B stage ... The PP communications in pipeline fill and flush are still exposed", only with
virtual pipelining; its MegatronCommOverlapCallback sets overlap_p2p_comm=True (and
batch_p2p_comm=False) whenever pipeline and virtual pipeline sizes are both above 1. So, per
microbatch of the steady state,

    hidden = min(p2p, compute)      exposed = p2p - hidden

and the fill and flush, whose hops wait for each transfer, keep the whole per-microbatch time
with its sends (pipeline_time.pipeline_time_s). The 1F1B and zero-bubble schedules are priced with
their sends exposed (Megatron batches them, batch_p2p_comm, and waits).
"""

from __future__ import annotations

OVERLAPPED_SCHEDULES = ("interleaved",)
"""Schedules whose steady-state sends overlap compute under overlap_p2p_comm (virtual pipelining)."""


def hidden_p2p_s(p2p_s: float, *, compute_s: float, schedule: str, num_stages: int) -> float:
    """Seconds of one microbatch's sends and receives that run beside other chunks' compute in the
    steady state (0 where the schedule waits on them)."""
    if num_stages <= 1 or schedule not in OVERLAPPED_SCHEDULES:
        return 0.0
    return max(0.0, min(p2p_s, compute_s))

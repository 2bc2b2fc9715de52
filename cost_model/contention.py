"""What communication overlapped with compute costs the compute: the SMs its kernels hold.

A collective that runs beside compute (FSDP2's all-gathers and reduce-scatters on their own
streams, tensor-parallel communication overlapped with the GEMMs) is not free for the compute
stream. NCCL runs a collective with one CUDA block per channel, and each block stays resident on
its SM until the collective ends (NCCL's documentation of NCCL_MIN_NCHANNELS: "increasing the
number of channels also increases the number of CUDA blocks NCCL uses ... however, it uses more
CUDA compute resources"). A GEMM or attention kernel that fills the device with one block per SM
(persistent and tile kernels sized to the SM count) then runs its tiles on the SMs left over:
for the seconds the collective runs, the compute progresses at (SMs - channels) / SMs of its
rate. Compute that the communication overlaps for `overlapped_s` seconds therefore finishes

    overlapped_s x channels / SMs

later than it would alone (the work the held SMs would have done in that window, done after it).
The figures are the device's SM count (datasheet) and the channels the collective library runs
with on the system (hardware.CollectiveSpec.channels, from the library's own logs); where either
is unknown (0) nothing is priced. Memory-bound kernels lose less than this (they are limited by
the memory bandwidth, not by the SMs), so for a step dominated by GEMMs this is the documented
share, not a fitted factor.

No torch and no autopar imports here.
"""

from __future__ import annotations


def sm_share(channels: int, sm_count: int) -> float:
    """Fraction of the device's SMs a collective's blocks hold while it runs (0 when unknown)."""
    if channels <= 0 or sm_count <= 0:
        return 0.0
    return min(1.0, channels / sm_count)


def overlap_slowdown_s(overlapped_s: float, *, channels: int, sm_count: int) -> float:
    """Seconds the compute is delayed by `overlapped_s` seconds of communication running beside it
    (module docstring)."""
    if overlapped_s <= 0:
        return 0.0
    return overlapped_s * sm_share(channels, sm_count)

"""Device memory the tensors of a plan do not account for: the CUDA context, NCCL's buffers and
the caching allocator's fragmentation. Each is a named term of a plan's memory breakdown.

    cuda context       the driver context with PyTorch's kernels loaded lazily
                       (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7) and cuBLAS
                       workspaces: about 0.5 GiB on A100/H100 (outside torch's allocator, so not
                       in torch.cuda.memory_reserved)
    NCCL buffers       per communicator NCCL_BUFFSIZE (4 MiB) per channel and ring peer (2), up to
                       32 channels on NVSwitch/InfiniBand systems: 256 MiB per communicator, one
                       per mesh axis that communicates
    fragmentation      PyTorch's caching allocator rounds requests (512 B; above 1 MiB into 2 MiB
                       or 20 MiB segments) and cannot hand a freed block of one size to a larger
                       request; what it reserves beyond what is allocated grows with the tensors
                       that come and go (activations, gathered FSDP units, recompute buffers), not
                       with the model states allocated once. A fraction of those dynamic bytes
                       (default 5%, an assumption: check torch.cuda.memory_stats()'s
                       reserved_bytes / allocated_bytes on your job and set it)

No torch and no autopar imports here.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class AllocatorModel:
    """Memory beyond the plan's tensors, per device."""

    cuda_context_bytes: float = 0.5 * GIB
    """Driver context, lazily loaded kernels, cuBLAS workspaces (outside the caching allocator)."""
    nccl_bytes_per_communicator: float = 256 * MIB
    """NCCL's send/receive buffers of one communicator (4 MiB x 2 ring peers x 32 channels)."""
    fragmentation_fraction: float = 0.05
    """Caching-allocator overhead, as a share of the dynamic (activation and buffer) bytes."""

    def __post_init__(self) -> None:
        for name in ("cuda_context_bytes", "nccl_bytes_per_communicator", "fragmentation_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"AllocatorModel.{name} must be >= 0, got {getattr(self, name)}")

    def context_bytes(self, num_communicators: int) -> float:
        """CUDA context plus NCCL buffers for `num_communicators` process groups."""
        return self.cuda_context_bytes + max(0, num_communicators) * self.nccl_bytes_per_communicator

    def fragmentation_bytes(self, dynamic_bytes: float) -> float:
        return self.fragmentation_fraction * max(0.0, dynamic_bytes)


DEFAULT_ALLOCATOR = AllocatorModel()
NO_OVERHEAD = AllocatorModel(cuda_context_bytes=0.0, nccl_bytes_per_communicator=0.0, fragmentation_fraction=0.0)
"""For CPU (gloo) planning and for closed-form tests: no CUDA context, no caching allocator."""

"""Per-device memory: model states under ZeRO, activations under a pipeline schedule.

Model states with mixed-precision Adam (Rajbhandari et al., ZeRO, arXiv 1910.02054), Psi
parameters, data-parallel degree N, K optimizer bytes per parameter:

    stage 0: params 2 Psi,   grads 2 Psi,   optimizer K Psi
    stage 1: params 2 Psi,   grads 2 Psi,   optimizer K Psi / N
    stage 2: params 2 Psi,   grads 2 Psi/N, optimizer K Psi / N
    stage 3: params 2 Psi/N, grads 2 Psi/N, optimizer K Psi / N

Activations in flight (microbatches whose backward has not run yet) on stage i of p with m
microbatches: GPipe m; 1F1B min(p - i, m); interleaved 1F1B with v chunks per device
p v + p - 1 - 2 i model chunks at most, each 1/v of the stage (Narayanan et al., SC21), not
alike: per chunk, `chunk_microbatches_in_flight` follows the schedule's order (the last rank
holds its last chunk, with the output layer, for one microbatch at a time).

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) free a microbatch's
activations only after its weight-gradient pass W; counted here as held whole until then (W
needs the inputs of every weight-bearing op and the output gradients kept at the cut between the
input- and the weight-gradient pass, most of the activations):
    zb1p   rank i defers its first i W passes after a warmup of (v - 1) p + p - 1 - i forwards:
           v p chunks, i.e. min(p, m) stage-microbatches on every rank (1F1B's first stage's
           p, now on every stage: the deferral costs rank i another i microbatches)
    zbv    rank i holds its chunk 0 (stage i) for min(2p - 1 - i, m) microbatches and its chunk 1
           (stage 2p - 1 - i) for min(i + 1, m) at the same moment, each chunk half a stage:
           p stage-microbatches when the chunks are equal
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from cost_model.optimizer import ADAMW_IO_BYTES_PER_PARAM

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv")


SP_LAYOUT_COPIES = ("batched_gathers", "all", "none")
"""PrecisionPolicy.sp_layout_copies' values."""


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Bytes per parameter of each model state."""

    param_bytes: float = 2.0
    """Working (compute) copy of the weights: bf16."""
    grad_bytes: float = 2.0
    """Gradients as reduced across data parallel: bf16."""
    optimizer_bytes: float = 12.0
    """fp32 master weights + Adam first and second moments."""
    activation_dtype: str = "bfloat16"
    """dtype activations are stored in."""
    gather_bytes: float | None = None
    """Bytes per parameter FSDP all-gathers (the sharded storage's dtype, or its param_dtype
    under a mixed-precision policy); None: param_bytes."""
    reduce_bytes: float | None = None
    """Bytes per gradient element reduced over data parallel (the reduce dtype); None: grad_bytes."""
    casts_once_per_step: bool = False
    """The runtime keeps fp32 parameters and uses bf16 copies made once per step (autopar's
    codegen): without FSDP each fp32 weight is cast when the step starts and the copy serves every
    microbatch (held for the whole step, `param_bytes` per element); each microbatch's backward
    casts the copies' gradients back to fp32 into the fp32 gradients. With FSDP2 the cast is its
    MixedPrecisionPolicy (param_dtype bf16): the shard is cast before each all-gather and the
    gradient goes to the reduce dtype in the reduce-scatter's copy-in. False: the weights are
    already in the compute dtype (Megatron-LM: its fp32 master copy lives in the optimizer)."""
    master_bytes: float = 4.0
    """Bytes per element of the weights the optimizer updates (fp32): what a once-per-step cast
    reads, and what FSDP2's CPU offload copies to the device before each all-gather."""
    optimizer_io_bytes_per_param: float = ADAMW_IO_BYTES_PER_PARAM["fused"]
    """Device memory one optimizer step reads and writes per parameter (cost_model/optimizer.py):
    fused AdamW unless the policy says otherwise."""
    tp_comm_overlap: bool = False
    """The runtime overlaps its sequence-parallel collectives with the GEMMs they feed
    (Megatron-Core / NeMo `tp_comm_overlap`, Transformer Engine userbuffers: solver/tp_overlap.py);
    autopar's runtime with async TP (Plan.tp_overlap "async"). False: they run exposed, as autopar's
    runtime issues them through DTensor with tp_overlap "off"."""
    tp_overlap_sums: bool = True
    """Under tp_comm_overlap, the reduce-scatter of a gradient autograd summed over several readers
    of one gathered input (q, k and v; gate and up) is overlapped too: Transformer Engine, as
    Megatron-Core runs those readers as one fused linear (linear_qkv, linear_fc1). False for torch's
    async TP (the inductor pass fuses a reduce-scatter only with the one matmul producing it) and
    autopar's runtime (codegen/async_tp.py): that reduce-scatter runs after the sum, exposed."""
    tp_overlap_passes: bool = False
    """Under tp_comm_overlap, the fused kernels' own memory passes where the runtime fuses with
    torch's symmetric-memory ops (torch's async TP and autopar's runtime: torch.distributed.
    _symmetric_memory): an all-gather copies the local shard into the symmetric buffer before its
    barrier (a read and a write of the shard), a reduce-scatter sums the tp partial outputs it
    pulled (a read of all of them, a write of the shard) after its last chunk; both exposed, in the
    layout-copy terms (solver/tp_windows.py). False: none (Transformer Engine's userbuffers
    reduce inside the communication kernels), or no overlap."""
    regather_overlap: bool = False
    """Where a recomputation mode keeps a sequence-parallel linear's input as its shard ("gathers",
    "selective"), the runtime all-gathers it again in backward beside that linear's input-gradient
    GEMM: Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication and Transformer Engine's
    linears issue the all-gather asynchronously before the dgrad GEMM and wait after it
    (solver/tp_overlap.py's overlap_regather). False: exposed, as autopar's runtime redistributes
    the shard through DTensor."""
    fsdp_root_ends: bool = False
    """The runtime's root FSDP unit holds the first and last segments' parameters (torchtitan:
    `fully_shard` on each transformer block, then on the whole model, so the embedding, the final
    norm and the output head are the root's), and keeps the last transformer block gathered from
    its forward to its backward (cost_model/fsdp.py's "root ends"). False: every segment is its
    own unit (torchtitan since 2025-07), unless `fsdp_small_root_ends`."""
    fsdp_small_root_ends: bool = False
    """As `fsdp_root_ends` where the first and last segments together hold no more parameters than
    the largest block (cost_model/fsdp.py's ends_fit_a_block), each segment its own unit elsewhere:
    autopar's runtime (codegen/data_parallel.py), as its plan records (Plan.fsdp_root_ends)."""
    p2p_overlap: bool = False
    """The runtime overlaps an interleaved pipeline's sends and receives with the compute of the
    other chunks in its steady state (Megatron-Core `overlap_p2p_comm`, which NeMo turns on
    whenever virtual pipelining is used: solver/p2p_overlap.py), and autopar's runtime: torch.
    distributed.pipelining runs the interleaved schedule as a _PipelineScheduleRuntime, which posts
    each receive as early as the sender's schedule allows, waits on it just before the compute that
    reads it, and waits on its sends only at the step's end (torch 2.13 schedules.py: _add_send_recv,
    _step_microbatches). False: each send is waited on before the next chunk runs."""
    sp_layout_copies: str = "batched_gathers"
    """What the runtime copies around a collective that gathers or scatters a dim other than 0
    (sequence parallelism on a (batch, seq, hidden) activation: DTensor's Shard(1)). NCCL gathers
    and scatters dim 0, so torch's functional collectives put the chunks in place with a torch.cat,
    a read and a write of the whole tensor on the compute stream: after an all-gather
    (all_gather_single) and before a reduce-scatter (reduce_scatter_single). "batched_gathers":
    torch since pytorch/pytorch#169404 (2025-12), whose all-gather is a view where the dims before
    the gathered one hold one element (a microbatch of one sequence), its reduce-scatter copying
    always (autopar's runtime); "all": torch before it; "none": Megatron-LM's (seq, batch,
    hidden) layout, gathered and scattered on dim 0."""
    param_gather_overlap: bool = True
    """ZeRO-1/2's all-gather of the updated parameters runs inside the step's first forward, each
    unit's one ahead of the compute that needs it (cost_model/fsdp.py's timeline): FSDP2's
    prefetch in autopar's runtime, and Megatron-Core's distributed optimizer with
    `overlap_param_gather` (distributed_data_parallel.py: each module's forward pre-hook waits for
    its bucket group's all-gather and dispatches the next one's). False: Megatron-Core without
    it (Megatron-LM's default), whose DistributedOptimizer.step_with_ready_grads all-gathers every
    bucket synchronously right after the optimizer step: all of it exposed (dp.all_gather.once)."""
    fsdp_copies: bool = True
    """Each data-parallel all-gather is copied out of, and each reduce-scatter into, a flat buffer of
    its own (FSDP2's foreach_all_gather_copy_out and foreach_reduce_scatter_copy_in: dp.copy_out,
    dp.copy_in; cost_model/fsdp.py copy_bytes), as autopar's runtime and torchtitan run. False:
    the parameters and gradients are views of the buffers the collectives read and write, nothing
    copied: Megatron-Core's distributed optimizer (param_and_grad_buffer.py: every bucket's
    param_data and grad_data hold the parameters' and main gradients' storage) and Megatron-FSDP
    (its DBuffer: one local storage tensor per group, each parameter a view of it)."""

    def with_torch_async_tp(self, on: bool = True) -> "PrecisionPolicy":
        """This policy under torch's async TP (its symmetric-memory kernels: torchtitan's and
        autopar's runtime), `on` or not: sequence-parallel collectives overlapped with their GEMMs
        (tp_comm_overlap), a summed gradient's reduce-scatter left out (tp_overlap_sums False), the
        fused kernels' own passes (tp_overlap_passes)."""
        return dataclasses.replace(self, tp_comm_overlap=on, tp_overlap_sums=False, tp_overlap_passes=True)

    def __post_init__(self) -> None:
        if self.sp_layout_copies not in SP_LAYOUT_COPIES:
            raise ValueError(f"sp_layout_copies {self.sp_layout_copies!r} is not one of {', '.join(SP_LAYOUT_COPIES)}")

    @property
    def model_state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def fsdp_gather_bytes(self) -> float:
        return self.param_bytes if self.gather_bytes is None else self.gather_bytes

    @property
    def dp_reduce_bytes(self) -> float:
        return self.grad_bytes if self.reduce_bytes is None else self.reduce_bytes


# autopar's codegen keeps fp32 parameters and makes bf16 copies once per step; FSDP2 gathers bf16
# (MixedPrecisionPolicy) and gradients are reduced in fp32.
BF16_ADAM = PrecisionPolicy(gather_bytes=2.0, reduce_bytes=4.0, casts_once_per_step=True, p2p_overlap=True,
                            fsdp_small_root_ends=True, optimizer_io_bytes_per_param=ADAMW_IO_BYTES_PER_PARAM["foreach"])
"""autopar's runtime with `torch.optim.AdamW(pm.parameters())` as the README writes it (foreach)."""
MEGATRON_BF16 = PrecisionPolicy(gather_bytes=2.0, reduce_bytes=4.0, regather_overlap=True, sp_layout_copies="none",
                                fsdp_copies=False)
"""Megatron-LM's mixed precision (for pricing runs made that way): bf16/fp16 parameters used
directly by every microbatch, the fp32 master copy inside the optimizer; no cast; its sequence-
parallel re-gathers beside the input-gradient GEMMs (`regather_overlap`). Its distributed
optimizer all-gathers the bf16 parameter buffer (2 bytes: megatron/core/distributed/
param_and_grad_buffer.py, each bucket's param_data in the parameters' dtype, gathered with
all_gather_into_tensor after the optimizer copies its fp32 shard in) and reduce-scatters the fp32
main gradients (grad_reduce_in_fp32), both buffers the parameters' and gradients' own storage
(no copy around the collectives: `fsdp_copies` False)."""
FP32_ADAM = PrecisionPolicy(param_bytes=4.0, grad_bytes=4.0, optimizer_bytes=8.0, activation_dtype="float32",
                            p2p_overlap=True, fsdp_small_root_ends=True,
                            optimizer_io_bytes_per_param=ADAMW_IO_BYTES_PER_PARAM["foreach"])
FSDP2_BF16_FP32_REDUCE = PrecisionPolicy(gather_bytes=2.0, reduce_bytes=4.0)
"""torchtitan's FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 gathers,
fp32 reduce-scatters (for pricing runs made that way; `fsdp_root_ends` for its wrapping until
2025-07)."""


@dataclass(frozen=True, kw_only=True)
class ModelStateMemory:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_state_memory(num_params: float, *, dp: int, zero_stage: int,
                       policy: PrecisionPolicy = BF16_ADAM) -> ModelStateMemory:
    """Bytes per device for `num_params` parameters (already divided by tensor/pipeline sharding)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    params = num_params * policy.param_bytes / (dp if zero_stage >= 3 else 1)
    grads = num_params * policy.grad_bytes / (dp if zero_stage >= 2 else 1)
    optimizer = num_params * policy.optimizer_bytes / (dp if zero_stage >= 1 else 1)
    return ModelStateMemory(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer)


def microbatches_in_flight(schedule: str, *, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """How many microbatches' activations of the whole stage are held at the peak."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(SCHEDULES)}")
    m, p = num_microbatches, num_stages
    if schedule == "gpipe" or p == 1:
        return float(m if schedule == "gpipe" else 1)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    if schedule == "zb1p":
        return float(min(p, m))
    if schedule == "zbv":
        return (chunk_microbatches_in_flight(schedule, rank=stage, chunk=0, num_stages=p, num_microbatches=m)
                + chunk_microbatches_in_flight(schedule, rank=stage, chunk=1, num_stages=p, num_microbatches=m)) / 2
    v = virtual_stages
    chunks = min(p * v + p - 1 - 2 * stage, m * v)
    return chunks / v


def chunk_microbatches_in_flight(schedule: str, *, rank: int, chunk: int, num_stages: int, num_microbatches: int,
                                 virtual_stages: int = 1) -> float:
    """Microbatches whose activations of one model chunk of `rank` are held at the rank's peak
    (for one chunk per rank, or chunks held alike, the rank's own count)."""
    if schedule == "zbv" and num_stages > 1:
        held = 2 * num_stages - 1 - rank if chunk == 0 else rank + 1
        return float(min(held, num_microbatches))
    if schedule == "interleaved" and num_stages > 1 and virtual_stages > 1:
        return float(_interleaved_held(rank, num_stages, virtual_stages, num_microbatches)[chunk])
    return microbatches_in_flight(schedule, stage=rank, num_stages=num_stages, num_microbatches=num_microbatches,
                                  virtual_stages=virtual_stages)


@functools.lru_cache(maxsize=4096)
def _interleaved_held(rank: int, p: int, v: int, m: int) -> tuple[int, ...]:
    """Per local chunk, the microbatches rank `rank` holds when its held total first peaks under
    interleaved 1F1B (Megatron-LM's order, torch's ScheduleInterleaved1F1B): warmup of
    (v - 1) p + 2 (p - 1 - rank) forwards, then one forward and one backward at a time; the k-th
    forward runs chunk (k // p) mod v, the k-th backward chunk v - 1 - (k // p) mod v. The
    total is p v + p - 1 - 2 rank chunks as in the module docstring; the split says which
    chunks: the last chunk of the last rank (the output layer and the loss) is held by one
    microbatch at a time, its first chunk by p."""
    total = m * v
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    held = [0] * v
    best, best_total = tuple(held), 0
    forwards = backwards = 0

    def forward() -> None:
        nonlocal forwards
        held[(forwards // p) % v] += 1
        forwards += 1

    while forwards < warmup:
        forward()
    while backwards < total:
        if forwards < total:
            forward()
        if sum(held) > best_total:
            best, best_total = tuple(held), sum(held)
        held[v - 1 - (backwards // p) % v] -= 1
        backwards += 1
    return best


def accumulated_gradient_peak(schedule: str, *, rank: int, num_stages: int, num_microbatches: int,
                              virtual_stages: int, chunk_activation_bytes: tuple[float, ...],
                              chunk_gradient_bytes: tuple[float, ...]) -> tuple[float, float] | None:
    """(activation bytes, gradient bytes) a pipeline rank holds at its peak of the two together,
    when each local chunk's gradients are accumulated unsharded from that chunk's first backward
    of the step until the step's reduce-scatter frees them (FSDP2 and ZeRO-2/3 runtimes under
    pipelining: no gradient sync before the last microbatch, the accumulator allocated by the
    first gradient written into it, freed after the step's reduce-scatter). A rank that holds its
    warmup's activations before any backward has no gradient yet at that moment; its first
    backward of a chunk fills that chunk's accumulator as it frees the microbatch's activations.

    Walks the rank's order as `_interleaved_held` does (GPipe: all forwards first; 1F1B: p - 1 -
    rank warmup forwards; interleaved: (v - 1) p + 2 (p - 1 - rank)). None for the zero-bubble
    schedules (their weight-gradient passes are deferred: gradients counted whole there) and for
    one stage."""
    if num_stages <= 1 or schedule not in ("gpipe", "1f1b", "interleaved"):
        return None
    p, m = num_stages, num_microbatches
    v = virtual_stages if schedule == "interleaved" else 1
    if schedule == "interleaved" and v <= 1:
        return None  # priced as microbatches_in_flight counts it
    if len(chunk_activation_bytes) != v or len(chunk_gradient_bytes) != v:
        raise ValueError(f"one activation and one gradient size per local chunk ({v}), got "
                         f"{len(chunk_activation_bytes)} and {len(chunk_gradient_bytes)}")
    return _accumulated_gradient_peak(schedule, rank, p, v, m, tuple(chunk_activation_bytes),
                                      tuple(chunk_gradient_bytes))


@functools.lru_cache(maxsize=4096)
def _accumulated_gradient_peak(schedule: str, rank: int, p: int, v: int, m: int, activations: tuple[float, ...],
                               gradients: tuple[float, ...]) -> tuple[float, float]:
    total = m * v
    if schedule == "gpipe":
        warmup = total
    elif v == 1:
        warmup = min(p - 1 - rank, total)
    else:
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    held, touched = [0] * v, [False] * v
    best, best_total = (0.0, 0.0), -1.0
    forwards = backwards = 0

    def note() -> None:
        nonlocal best, best_total
        held_bytes = sum(count * size for count, size in zip(held, activations))
        grad_bytes = sum((size for seen, size in zip(touched, gradients) if seen), 0.0)
        if held_bytes + grad_bytes > best_total:
            best, best_total = (held_bytes, grad_bytes), held_bytes + grad_bytes

    def forward() -> None:
        nonlocal forwards
        held[(forwards // p) % v] += 1
        forwards += 1
        note()

    while forwards < warmup:
        forward()
    while backwards < total:
        if forwards < total:
            forward()
        chunk = v - 1 - (backwards // p) % v
        # One backward frees the microbatch's activations of the chunk layer by layer as it
        # fills the chunk's gradients: the larger of the two ends, before (noted after the last
        # forward) and after it, bounds it.
        touched[chunk] = True
        held[chunk] -= 1
        backwards += 1
        note()
    return best


def activation_memory(saved_bytes_per_microbatch: float, *, schedule: str, stage: int, num_stages: int,
                      num_microbatches: int, virtual_stages: int = 1) -> float:
    """Peak saved-activation bytes on one pipeline stage."""
    return saved_bytes_per_microbatch * microbatches_in_flight(
        schedule, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches,
        virtual_stages=virtual_stages)

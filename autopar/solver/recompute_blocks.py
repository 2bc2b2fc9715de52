"""Full recomputation of some blocks: the "blocks:<N>" mode.

Megatron-Core's `recompute_granularity=full, recompute_method=block, recompute_num_layers=N`
checkpoints the first N transformer layers of each model chunk (each virtual pipeline stage) and
keeps every activation of the others; torchtitan's layer checkpointing (`selective_ac_option` k)
checkpoints every k-th block. Under "blocks:N" the first N repeated blocks of each model chunk run
as under "full" (only their input kept, their forward run again in backward) and every other
segment as under "none"; with one chunk of B blocks, torchtitan's every k-th block is "blocks:B/k"
priced alike (the same blocks counted, in other positions).

Which blocks: the chunks of the configuration's split by count (solver/pipeline.py split_spans),
and for autopar's balanced cut those of the uniform one ("uniform": B / chunks blocks each), so
the price (solver/pricing.py: PreparedSegments.mixed of the two modes' rows), the plan's report
and the runtime (codegen/build.py) recompute the same blocks whatever cut the stages take.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.errors import ConfigError
from autopar.solver.pipeline import BALANCED, block_flags, split_spans

BLOCKS_PREFIX = "blocks:"
"""Mode prefix: "blocks:5" recomputes the first 5 blocks of each model chunk in full."""


def is_blocks_mode(mode: str) -> bool:
    return isinstance(mode, str) and mode.startswith(BLOCKS_PREFIX)


def block_count(mode: str, what: str = "recompute") -> int:
    """N of a "blocks:<N>" mode (a ConfigError when N is not a whole number >= 1)."""
    text = mode[len(BLOCKS_PREFIX):]
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{what} {mode!r}: 'blocks:N' takes a whole number of blocks N >= 1 recomputed in full per "
                          "model chunk (e.g. 'blocks:5', Megatron-Core's recompute_num_layers=5)")
    return int(text)


def blocks_mode(count: int, what: str = "--recompute-blocks") -> str:
    """The mode string recomputing `count` blocks per chunk (checked)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{what} takes a whole number of blocks >= 1 per model chunk, got {count!r}")
    return f"{BLOCKS_PREFIX}{count}"


def recomputed_flags(is_block: Sequence[bool], *, num_chunks: int, split: str, mode: str) -> tuple[bool, ...]:
    """Per segment, whether "blocks:<N>" recomputes it: the first N blocks of each chunk of the
    split (the uniform one for the balanced cut). A ConfigError when the model has no repeated
    blocks or a chunk holds fewer than N of them."""
    count = block_count(mode)
    if not any(is_block):
        raise ConfigError(f"recompute {mode!r} counts repeated blocks, and this model has none (no segment repeats): "
                          "use 'full' or another mode")
    spans = _spans(is_block, num_chunks, split)
    flags = [False] * len(is_block)
    for span in spans:
        blocks = [index for index in range(span.start, span.stop) if is_block[index]]
        if len(blocks) < count:
            raise ConfigError(f"recompute {mode!r}: model chunk {spans.index(span)} of {num_chunks} holds "
                              f"{len(blocks)} block(s), fewer than {count}: recompute at most {len(blocks)} per chunk "
                              "('full' recomputes them all)")
        for index in blocks[:count]:
            flags[index] = True
    return tuple(flags)


def blocks_blocker(is_block: Sequence[bool], *, num_chunks: int, split: str, mode: str) -> str:
    """Why `mode` cannot recompute its blocks on these chunks ("" when it can): recomputed_flags' refusal."""
    try:
        recomputed_flags(is_block, num_chunks=num_chunks, split=split, mode=mode)
    except ConfigError as error:
        return str(error)
    return ""


def holds_others(is_block: Sequence[bool], *, num_chunks: int, split: str, mode: str) -> bool:
    """Whether every chunk keeps a block it does not recompute. A chunk's recomputed blocks are
    its first, so their backward runs last, after the kept blocks' activations of the same
    microbatch are freed: one block's regenerated tensors then fit in what was freed, and the
    stage's peak needs no recompute workspace (as under "full", where nothing is freed first)."""
    count = block_count(mode)
    spans = _spans(is_block, num_chunks, split)
    return all(sum(is_block[span.start:span.stop]) > count for span in spans)


def _spans(is_block: Sequence[bool], num_chunks: int, split: str):
    return split_spans(is_block, num_chunks, "uniform" if split == BALANCED else split)


def recomputed_names(segments, *, mode: str, num_chunks: int, split: str) -> frozenset[str]:
    """Names of the segments (graph.Segment) "blocks:<N>" recomputes (recomputed_flags); none
    under another mode."""
    if not is_blocks_mode(mode):
        return frozenset()
    flags = recomputed_flags(block_flags(segments), num_chunks=num_chunks, split=split, mode=mode)
    return frozenset(segment.name for segment, recomputed in zip(segments, flags) if recomputed)


def segment_mode(mode: str, name: str, recomputed: frozenset[str]) -> str:
    """The mode one segment runs under: "full" or "none" under "blocks:<N>" (by `recomputed`,
    the names of the segments it recomputes), else `mode` itself."""
    if not is_blocks_mode(mode):
        return mode
    return "full" if name in recomputed else "none"


class RecomputedBlocks:
    """Which of a graph's nodes "blocks:<N>" runs again in backward: those in the segments it
    recomputes (recomputed_names), kept per (mode, chunks, split) for the pricing that asks per op."""

    def __init__(self, segments) -> None:
        self.segments = segments
        self._segment_of = {node: segment.name for segment in segments for node in segment.nodes}
        self._names: dict[tuple[str, int, str], frozenset[str]] = {}

    def holds(self, node: str, *, mode: str, num_chunks: int, split: str) -> bool:
        key = (mode, num_chunks, split)
        if key not in self._names:
            self._names[key] = recomputed_names(self.segments, mode=mode, num_chunks=num_chunks, split=split)
        return self._segment_of.get(node) in self._names[key]

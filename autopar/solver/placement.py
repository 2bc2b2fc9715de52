"""Where one pipeline rank sits in a configuration's stage partition, worked out once.

The step model reads a rank's placement several times per configuration: for the lower bound
under the lightest mode, for the choice of each stage's recomputation mode, for the bound of the
chosen modes and for building the stage. A placement is the same each time: the rank's global
stages (model chunks) and their spans, the microbatches each chunk holds in flight, and its
send/receive seconds. The sends read each chunk's output bytes, which no recomputation mode
changes (every mode's PreparedSegments comes from the same segment costs), so one placement
serves every mode; what does depend on the mode, the signature of the rank's segments (the key
of the step model's caches), is kept per mode the first time it is asked for.
"""

from __future__ import annotations

from autopar.solver.pipeline import StageSpan
from autopar.solver.prepared import PreparedSegments


class Placement:
    """One pipeline rank of one configuration under one stage partition."""

    __slots__ = ("stage", "stage_indices", "own", "in_flight", "p2p_s", "_signatures")

    def __init__(self, *, stage: int, stage_indices: tuple[int, ...], own: list[StageSpan],
                 in_flight: list[float], p2p_s: float) -> None:
        self.stage = stage
        """The pipeline rank."""
        self.stage_indices = stage_indices
        """Its global stages (model chunks), in local chunk order."""
        self.own = own
        """The segment span of each of those chunks."""
        self.in_flight = in_flight
        """Per chunk, the microbatches whose activations the rank holds at its peak."""
        self.p2p_s = p2p_s
        """Send/receive seconds per microbatch (forward activations out, their gradients back)."""
        self._signatures: dict[int, tuple[int, ...]] = {}

    def signature(self, prepared: PreparedSegments) -> tuple[int, ...]:
        """prepared.signature(own), computed once per mode's segments."""
        key = id(prepared)
        found = self._signatures.get(key)
        if found is None:
            found = self._signatures[key] = prepared.signature(self.own)
        return found

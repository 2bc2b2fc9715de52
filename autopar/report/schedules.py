"""The pass order of each pipeline schedule, for the timeline pictures: it lives in
autopar/solver/schedules.py, where the step model also lays ZB-V's bubble out from it."""

from autopar.solver.schedules import SPLIT_BACKWARD, Step, rank_order

__all__ = ["SPLIT_BACKWARD", "Step", "rank_order"]

"""autopar: automatic parallelization planner and compiler for PyTorch training."""

from autopar.errors import (
    AutoparError,
    CaptureError,
    ClusterSpecError,
    ConfigError,
    InfeasiblePlanError,
    ModelSpecError,
    PlanMismatchError,
    ProfileError,
)

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "CaptureError",
    "ClusterSpecError",
    "ConfigError",
    "InfeasiblePlanError",
    "ModelSpecError",
    "PlanMismatchError",
    "ProfileError",
    "__version__",
]

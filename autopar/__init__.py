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


def __getattr__(name: str):
    """The API is imported lazily: `import autopar` stays cheap for the CLI."""
    if name in ("plan", "evaluate", "capture_for_planning", "planner_for"):
        from autopar.plans import planning  # not autopar.api: planning alone does not import codegen

        return getattr(planning, name)
    if name == "parallelize":
        from autopar.api import parallelize

        return parallelize
    if name == "verify":  # not autopar.api: verify spawns its own processes and needs no process group here
        from autopar.tune.verify import verify

        return verify
    if name == "Cluster":
        from autopar.cluster import Cluster

        return Cluster
    if name == "Plan":
        from autopar.plans.plan import Plan

        return Plan
    if name == "capture":  # the capture stage's package: autopar.capture.capture(model, inputs)
        import importlib

        return importlib.import_module("autopar.capture")
    raise AttributeError(f"module 'autopar' has no attribute '{name}'")

__all__ = [
    "Cluster",
    "Plan",
    "evaluate",
    "parallelize",
    "plan",
    "verify",
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

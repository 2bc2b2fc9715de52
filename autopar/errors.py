"""User-facing errors.

Every error a user can cause derives from `AutoparError`. Its message says what was wrong and
what to do; the CLI prints it (no traceback) and exits with status 2.
"""


class AutoparError(Exception):
    """Base class of every error caused by user input (model, cluster, plan, profile)."""


class ClusterSpecError(AutoparError, ValueError):
    """A cluster spec string or TOML file is malformed."""


class ModelSpecError(AutoparError, ValueError):
    """A model name, override or `file.py:factory` reference is malformed."""


class CaptureError(AutoparError, RuntimeError):
    """The model could not be traced into an op graph."""


class ProfileError(AutoparError, ValueError):
    """A hardware profile file is missing, corrupt or made for another device or version."""


class InfeasiblePlanError(AutoparError, RuntimeError):
    """No parallelization fits the model into device memory."""


class PlanMismatchError(AutoparError, ValueError):
    """A plan was made for another model, cluster or input shape."""


class ConfigError(AutoparError, ValueError):
    """A parallel configuration or planning constraint is invalid for this model and cluster."""

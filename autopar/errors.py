"""User-facing errors.

Every error a user can cause derives from `AutoparError`. Its message says what was wrong and
what to do; the CLI prints it (no traceback) and exits with status 2.
Long values are cut in every message: a 100,000-character name or a 10 MB string from a
hand-edited file is shown by its first characters and its length.
"""

import re

LONG_RUN_CHARS = 160
"""Longest run of non-blank characters kept whole in a message."""
_LONG_RUN = re.compile(r"\S{%d,}" % (LONG_RUN_CHARS + 1))


def clip_long_runs(message: str) -> str:
    """Each run of more than LONG_RUN_CHARS non-blank characters, cut with its length said."""
    return _LONG_RUN.sub(lambda run: f"{run.group()[:LONG_RUN_CHARS - 40]}...({len(run.group()):,} characters)",
                         message)


class AutoparError(Exception):
    """Base class of every error caused by user input (model, cluster, plan, profile)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(clip_long_runs(message) if isinstance(message, str) else message, *args)


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

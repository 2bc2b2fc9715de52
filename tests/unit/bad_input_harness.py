"""Shared checks of the bad-input tests: every case ends in seconds with one clear message.

A CLI case runs `autopar.cli.main(argv)` in this process (no interpreter start-up per case) under
an alarm, so a hang fails the test instead of the suite; an API case expects an AutoparError.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

import pytest
import torch._dynamo  # noqa: F401 - imported here, never under a case's alarm (an interrupted
import torch.export  # noqa: F401   import leaves torch half-initialised for every later case)

import autopar.api  # noqa: F401
import autopar.capture.fx  # noqa: F401
import autopar.tune.profile  # noqa: F401
from autopar.cli import main
from autopar.errors import AutoparError

CASE_TIMEOUT_S = int(os.environ.get("AUTOPAR_CASE_TIMEOUT_S", "60"))
"""Far above what a clear error needs (under a second, a few for a capture on a loaded machine): a
hang, not a slow run. Modules a case imports lazily are imported by the test modules beforehand, so
that the alarm never interrupts an import."""
MAX_MESSAGE_CHARS = 2000
"""One paragraph, with long values truncated."""

TINY = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
"""A model that captures in a second or two."""
FOUR_GPUS = "dgx-a100-80g:gpus_per_node=4"


class CaseTimeout(Exception):
    """Raised by the alarm inside a case that ran too long."""


@contextlib.contextmanager
def deadline(seconds: int = CASE_TIMEOUT_S):
    def on_alarm(signum, frame):
        raise CaseTimeout(f"no answer within {seconds} s: the input hangs")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Outcome:
    code: int | None
    out: str
    err: str


def run_cli(capsys, argv: list[str]) -> Outcome:
    import sys

    capsys.readouterr()
    # sys.argv as the `autopar` command has it (a model file may read it), not the test runner's.
    saved, sys.argv = sys.argv, ["autopar", *(str(arg) for arg in argv)]
    try:
        with deadline():
            try:
                code = main([str(arg) for arg in argv])
            except SystemExit as stop:  # argparse's own usage errors
                code = stop.code
    finally:
        sys.argv = saved
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def assert_clear(outcome: Outcome, *fragments: str) -> None:
    """Exit 2, nothing on stdout, no traceback, a short message naming the problem."""
    assert outcome.code == 2, f"exit {outcome.code} (accepted?); stdout: {outcome.out[:300]!r} stderr: {outcome.err[:300]!r}"
    assert "Traceback" not in outcome.err, f"traceback: {outcome.err[-1500:]}"
    assert outcome.out == "", f"stdout should be empty on error: {outcome.out[:300]!r}"
    assert 0 < len(outcome.err) <= MAX_MESSAGE_CHARS, f"message of {len(outcome.err)} chars: {outcome.err[:300]!r}"
    lowered = outcome.err.lower()
    for fragment in fragments:
        assert fragment.lower() in lowered, f"message lacks {fragment!r}: {outcome.err!r}"


def cli_error(capsys, argv: list[str], *fragments: str) -> Outcome:
    outcome = run_cli(capsys, argv)
    assert_clear(outcome, *fragments)
    return outcome


def api_error(function, *fragments: str, error_type: type[AutoparError] = AutoparError) -> AutoparError:
    """`function()` raises `error_type` (an AutoparError) whose short message holds `fragments`."""
    with deadline():
        with pytest.raises(AutoparError) as caught:
            function()
    error = caught.value
    assert isinstance(error, error_type), f"{type(error).__name__}: {error}"
    message = str(error)
    assert len(message) <= MAX_MESSAGE_CHARS, f"message of {len(message)} chars: {message[:300]!r}"
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"message lacks {fragment!r}: {message!r}"
    return error

"""The watchdog: a failed collective of any phase of a step names the rank that is behind."""

from __future__ import annotations

import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from autopar.codegen import watchdog
from autopar.codegen.watchdog import PHASES, PeerStoppedError


@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0 of 2; rank 1 recorded step 2's loss all-reduce; the places rank 0 records are kept."""
    recorded = []
    place = {0: 0, 1: 2 * len(PHASES) + PHASES.index("loss all-reduce")}
    monkeypatch.setattr(watchdog.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(watchdog, "_store", lambda: object())
    monkeypatch.setattr(watchdog, "progress", lambda: dict(place))
    monkeypatch.setattr(watchdog, "record", lambda step, phase: recorded.append((step, phase)))
    return recorded


def test_a_timed_out_clipping_names_the_rank_behind_and_where_it_stopped(two_ranks):
    with pytest.raises(PeerStoppedError) as caught:
        with watchdog.watched(2, "gradient clipping"):
            raise RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")
    said = str(caught.value)
    assert "a collective of gradient clipping after train_step 2 failed" in said
    assert "rank 1 stopped answering (its last recorded place: step 2, loss all-reduce)" in said
    assert two_ranks == [(2, "gradient clipping")]


def test_a_failed_checkpoint_write_is_named_too(two_ranks):
    failure = (RuntimeError("Connection closed by peer"), traceback.StackSummary())
    with pytest.raises(PeerStoppedError, match="checkpoint save after train_step 2 failed: rank 1"):
        with watchdog.watched(2, "checkpoint save"):
            raise CheckpointException("save failed", {0: failure})


def test_train_step_phases_keep_their_wording_and_other_errors_pass_through(two_ranks):
    with pytest.raises(PeerStoppedError, match=r"collective of train_step 3 \(gradient sync\) failed: rank 1"):
        with watchdog.watched(3, "gradient sync"):
            raise RuntimeError("Connection reset by peer")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not a collective's failure
        with watchdog.watched(3, "forward and backward"):
            raise RuntimeError("shape mismatch: 3 vs 4")


def test_a_store_that_does_not_answer_is_asked_once(monkeypatch):
    asked = []

    class SilentStore:
        def set_timeout(self, timeout):
            pass

        def check(self, keys):
            asked.append(keys)
            raise RuntimeError("wait timeout after 5000ms")

    monkeypatch.setattr(watchdog.dist, "get_world_size", lambda: 512)
    monkeypatch.setattr(watchdog, "_store", lambda: SilentStore())
    assert watchdog.progress() == {rank: -1 for rank in range(512)}
    assert len(asked) == 1

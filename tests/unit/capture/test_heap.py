import gc
import os
import subprocess
import sys
import weakref

import pytest

from autopar.capture.heap import YOUNG_THRESHOLD, collector_paused, freeze_more, frozen_heap


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()  # no test starts with (or leaves) a frozen heap
    yield
    gc.unfreeze()


def test_frozen_heap_freezes_until_the_outermost_phase_ends():
    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        made_between = [[] for _ in range(1000)]  # tracked containers made inside the outer phase
        with frozen_heap():
            assert gc.get_freeze_count() >= outer + len(made_between) - 100  # (a few frozen objects may die)
        assert gc.get_freeze_count() >= outer + len(made_between) - 100  # the inner end does not thaw
    assert gc.get_freeze_count() == 0


def test_frozen_heap_raises_the_young_threshold_and_restores_it():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        with frozen_heap():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
            with frozen_heap():
                assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(50_000, 5, 5)  # a program's larger threshold is kept
        with frozen_heap():
            assert gc.get_threshold() == (50_000, 5, 5)
        assert gc.get_threshold() == (50_000, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_freeze_more_freezes_only_inside_a_phase_that_froze():
    freeze_more()  # outside any phase: nothing
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        made = [[] for _ in range(1000)]
        freeze_more()
        assert gc.get_freeze_count() >= outer + len(made) - 100
    assert gc.get_freeze_count() == 0


def test_frozen_heap_is_a_decorator_too():
    @frozen_heap()
    def inside() -> int:
        return gc.get_freeze_count()

    assert inside() > 0 and inside() > 0  # a fresh phase per call
    assert gc.get_freeze_count() == 0


def test_frozen_heap_thaws_after_an_exception():
    with pytest.raises(ValueError):
        with frozen_heap():
            raise ValueError("boom")
    assert gc.get_freeze_count() == 0
    with frozen_heap():  # and the next phase freezes again
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_heap_the_program_froze_is_left_alone():
    gc.freeze()
    frozen = gc.get_freeze_count()
    extra = [[] for _ in range(1000)]
    with frozen_heap():
        assert gc.get_freeze_count() <= frozen  # the program's freeze is not added to (the 1,000 lists)
    assert frozen - 100 < gc.get_freeze_count() <= frozen and extra  # nor undone (frozen objects may die)


def test_objects_left_in_cycles_while_frozen_are_collected_after():
    class Node:
        pass

    with frozen_heap():
        node = Node()
        node.self = node
        alive = weakref.ref(node)
        with frozen_heap():  # freezes the cycle
            del node
            gc.collect()
            assert alive() is not None  # frozen: skipped by collections
    gc.collect()
    assert alive() is None  # thawed at the end: collected as usual


def test_collector_paused_restores_the_previous_state():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a program that turned it off keeps it off
    finally:
        gc.enable()
    with pytest.raises(KeyError):
        with collector_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_freeze_at_exit_freezes_before_the_interpreter_tears_down():
    probe = ("import atexit, gc\n"
             "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
             "from autopar.capture.heap import freeze_at_exit\n"
             "freeze_at_exit(); freeze_at_exit()\n"
             "print('not frozen before exit:', gc.get_freeze_count() == 0)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.stdout.splitlines() == ["not frozen before exit: True", "frozen at exit: True"]

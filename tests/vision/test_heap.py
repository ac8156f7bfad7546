"""freeze_heap: what is alive when it runs is never collected again; what comes later still is."""

from __future__ import annotations

import gc
import weakref

from vision.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_alive_at_the_freeze_stay_and_later_cycles_are_collected() -> None:
    before = _Node()
    before_ref = weakref.ref(before)
    try:
        assert freeze_heap() == gc.get_freeze_count() > 0
        del before
        after = _Node()
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None  # made after the freeze: collected as ever
        assert before_ref() is not None  # frozen: no collection walks it
    finally:
        gc.unfreeze()
    gc.collect()
    assert before_ref() is None  # unfrozen, it is garbage again

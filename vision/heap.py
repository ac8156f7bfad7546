"""The collector and a long-lived process: what it loaded at start stays out of every collection.

A serving process holds millions of objects from its start (torch, transformers, the tokenizer,
the model's modules); a full (oldest-generation) collection walks them all, 150-300 ms with the
event loop stopped, and request bursts allocate enough to trigger one every few seconds. Moving
the start's objects to the permanent generation (``gc.freeze``) leaves a collection only the
objects made since, as vLLM does in its API server and engine.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_heap"]


def freeze_heap() -> int:
    """Collect the start's garbage, then exempt every object still alive from later collections;
    the number exempted."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

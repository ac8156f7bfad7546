"""A cache folder written once: built beside its final place, then renamed in.

Concurrent processes and interrupted writes never leave a half-written folder where a reader looks:
a reader trusts the folder only when the file ``marker`` is in it, the writer's last file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["written_once"]


def written_once(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(folder)`` unless it holds ``marker`` already; ``write`` writes
    ``marker`` last. Another process that wins the race to rename its copy in wins: its folder is kept."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / marker).exists():
                raise  # not a lost race with another writer: a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

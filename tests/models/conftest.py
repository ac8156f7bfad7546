"""Each family's tiny checkpoint, built once per test session on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models.checkpoints import family_dirs


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return family_dirs(tmp_path_factory)

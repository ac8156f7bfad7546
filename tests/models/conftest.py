"""Each family's tiny checkpoint, built once per test session on first use; the real SmolLM2 checkpoint,
converted from its GGUF file once per machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models.checkpoints import family_dirs
from tests.models.real_model import open_smollm2
from vision.checkpoint import Checkpoint


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return family_dirs(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    return open_smollm2()

"""The Python API example runs as a newcomer would run it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def test_python_api_example(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLES / "python_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    await module.main()
    first_line = capsys.readouterr().out.splitlines()[0]
    assert json.loads(first_line)["shape"] in ("circle", "square", "triangle")

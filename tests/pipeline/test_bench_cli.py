"""The ``bench`` command line: a scenario that cannot be imported stays listed and says why."""

from __future__ import annotations

import urllib.request

import pytest

from pipeline import bench
from pipeline.bench.health import _IdleServer
from pipeline.cli import main


def test_every_scenario_parses_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in bench.SCENARIOS) and "unavailable" not in listing


@pytest.mark.parametrize("extra", [[], ["--steps", "3"], ["--help"]])
def test_a_scenario_that_fails_to_import_says_which_module_and_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    monkeypatch.setitem(bench.SCENARIOS, "broken", "no_such_module")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "broken" in capsys.readouterr().out
    assert main(["bench", "broken", *extra]) == 2
    err = capsys.readouterr().err
    assert "pipeline.bench.no_such_module" in err and "ModuleNotFoundError" in err


@pytest.mark.parametrize("scenario", ["prep", "guided", "forced", "ahead", "tpot-under-load", "cache"])
def test_the_model_scenarios_take_a_checkpoint_folder(scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", scenario, "--help"])
    assert info.value.code == 0
    assert "--model MODEL" in capsys.readouterr().out


def test_ahead_runs_and_refuses_too_few_steps_for_its_batch(capsys: pytest.CaptureFixture[str]) -> None:
    """One token a sequence (its prefill's) gives no two steps in a row that hold the whole batch: the
    scenario says so rather than dividing by zero."""
    assert main(["bench", "ahead", "--batches", "2", "--steps", "12", "--pairs", "1", "--device", "cpu"]) == 0
    assert '"scenario": "ahead"' in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="no two full-batch steps in a row at batch 8"):
        main(["bench", "ahead", "--batches", "8", "--steps", "1", "--pairs", "1", "--device", "cpu"])


def test_the_checkpoint_command_lists_its_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["checkpoint", "--help"])
    assert info.value.code == 0
    assert "pixtral-7b" in capsys.readouterr().out


def test_the_health_floor_is_an_idle_server_that_answers_and_stops() -> None:
    """``bench health --floor`` probes this server beside the one measured."""
    idle = _IdleServer()
    try:
        with urllib.request.urlopen(f"{idle.base}/health", timeout=60) as resp:
            assert resp.status == 200 and resp.read() == b'{"status": "ok"}'
    finally:
        idle.stop()
    assert idle.proc.exitcode is not None


def test_forced_runs_its_three_kinds_and_reports_steps_and_shares(capsys: pytest.CaptureFixture[str]) -> None:
    """A short run: every figure is there, and the forced answers take fewer steps than one per token."""
    import json

    args = ["bench", "forced", "--batches", "1", "--repeats", "1", "--max-tokens", "24", "--device", "cpu"]
    assert main(args) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["scenario"] == "forced" and {r["backend"] for r in figures["results"]} == {"xgrammar", "llguidance"}
    for row in figures["results"]:
        assert row["steps_per_answer_forced"] < row["steps_per_answer_one"] and 0 < row["forced_share"] < 1

"""Models named as users name them: ``ORG/NAME`` through a Hugging Face cache laid out as the Hub lays
it out (never the network: ``HF_HUB_OFFLINE=1``), a GGUF file converted once, and a model that cannot
be found or read refused in one line by ``python -m pipeline serve``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import huggingface_hub
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from vision import gguf_checkpoint
from vision.checkpoint import ModelUnavailable, open_checkpoint

FamilyDir = Callable[[str], Path]
REPO = "acme/tiny-llama"
MESSAGES = [{"role": "user", "content": "Hello world"}]


def lay_out_hub_cache(folder: Path, cache: Path, repo_id: str) -> Path:
    """``folder``'s files in ``cache`` as the Hub's downloads leave them: content-named blobs, a snapshot
    of links to them under a commit, and ``refs/main`` naming that commit; returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline; huggingface_hub read both variables when it was imported."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


async def test_a_hub_name_is_served_from_the_cache(hub_cache: Path, family_dir: FamilyDir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = family_dir("llama3.0")
    snapshot = lay_out_hub_cache(folder, hub_cache, REPO)
    checkpoint = open_checkpoint(REPO, tmp_path / "cache")
    assert checkpoint.path == snapshot.resolve() and checkpoint.model_name == REPO
    prompt = checkpoint.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    config = PipelineConfig(
        model=REPO, device="cpu", max_running_seqs=2, num_kv_blocks=32, max_model_len=256, engine_mode="thread"
    )
    with anyio.fail_after(120):
        async with Pipeline(config) as pipe:
            assert pipe.model_name == REPO
            result = await (await pipe.submit({"messages": MESSAGES, "max_tokens": 8, "temperature": 0})).result()
    assert result.token_ids == expected.tolist()[: len(result.token_ids)]


def test_a_local_folder_wins_over_a_hub_name(
    hub_cache: Path, family_dir: FamilyDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = family_dir("llama3.0")
    lay_out_hub_cache(folder, hub_cache, REPO)
    local = tmp_path / REPO
    local.parent.mkdir()
    local.symlink_to(folder, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    checkpoint = open_checkpoint(REPO, tmp_path / "cache")
    assert checkpoint.path == folder.resolve() and checkpoint.model_name == folder.name


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("acme/missing", "model 'acme/missing' not found: no such folder, and not in the Hugging Face cache"),
        ("no such/name", "model 'no such/name' not found: no such folder or .gguf file, nor a Hugging Face model"),
        ("missing.gguf", "model 'missing.gguf' not found: no such GGUF file"),
    ],
)
def test_a_model_that_is_nowhere_is_named(hub_cache: Path, tmp_path: Path, model: str, message: str) -> None:
    with pytest.raises(ModelUnavailable) as caught:
        open_checkpoint(model, tmp_path / "cache")
    assert str(caught.value).startswith(message)
    if model == "acme/missing":
        assert f"({hub_cache}) while downloads are off (HF_HUB_OFFLINE=1)" in str(caught.value)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailable, match=r"is not a checkpoint folder \(no config.json\)"):
        open_checkpoint(str(tmp_path / "empty"), tmp_path / "cache")


def write_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file whose metadata names ``architecture``, with one small tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_architecture_transformers_cannot_read_is_named(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "odd.gguf", "acme-net")
    with pytest.raises(ModelUnavailable) as caught:
        open_checkpoint(str(file), tmp_path / "cache")
    message = str(caught.value)
    assert message.startswith(f"{file}: transformers cannot read this GGUF file") and "acme-net" in message
    assert "\n" not in message
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(
    tmp_path: Path, family_dir: FamilyDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion itself is the real-model tests' (tests/models/test_real_model.py): here a stand-in
    that copies a tiny checkpoint, counted."""
    converted: list[Path] = []

    def convert(file: Path, folder: Path) -> None:
        converted.append(file)
        for part in family_dir("llama3.0").iterdir():
            (folder / part.name).write_bytes(part.read_bytes())

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", convert)
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF stand-in")
    first = open_checkpoint(str(file), tmp_path / "cache")
    assert open_checkpoint(str(file), tmp_path / "cache") is first and len(converted) == 1
    assert first.model_name == "model" and first.path.parent == (tmp_path / "cache" / "gguf").resolve()
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = open_checkpoint(str(file), tmp_path / "cache")
    assert second.path != first.path and len(converted) == 2
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("kind", ["hub name", "gguf architecture"])
def test_serve_refuses_a_model_it_cannot_find_or_read_in_one_line(tmp_path: Path, kind: str) -> None:
    if kind == "hub name":
        model, expected = "acme/missing", "error: model 'acme/missing' not found: no such folder"
    else:
        model = str(write_gguf(tmp_path / "odd.gguf", "acme-net"))
        expected = f"error: {model}: transformers cannot read this GGUF file"
    command = [sys.executable, "-m", "pipeline", "serve", "--model", model, "--port", "0"]
    (tmp_path / "hub").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    env["VLM_PIPELINE_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr

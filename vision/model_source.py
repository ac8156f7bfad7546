"""Where a model named as users name it comes from: a checkpoint folder, a GGUF file, or a name on
the Hugging Face Hub (``ORG/NAME``) resolved through the Hugging Face cache.

A folder wins over a Hub name, as in transformers. A Hub name is looked up in the cache and downloaded
into it where the network allows (``HF_HUB_OFFLINE=1``: the cache only); either way the rest of the
project reads a local folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vision.gguf_checkpoint import GGUF_SUFFIX, gguf_checkpoint

__all__ = ["HUB_FILE_PATTERNS", "ModelUnavailable", "ResolvedModel", "resolve_model"]

# what serving reads: config, weights, tokenizer, chat template, processor and generation config
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# Mistral's repos ship their own format beside the transformers one: the same weights twice
_HUB_IGNORED = ["consolidated*.safetensors", "original/*"]


class ModelUnavailable(ValueError):
    """The model cannot be found or read (the message says which model and why, on one line)."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model's checkpoint folder on this machine, and the name it is served under."""

    path: Path
    name: str


def resolve_model(model: str, cache_dir: Path) -> ResolvedModel:
    """The checkpoint folder of ``model``: a folder, a ``.gguf`` file (converted once into ``cache_dir``)
    or a Hugging Face Hub name (from the Hugging Face cache, downloaded into it when missing and online).

    :raises ModelUnavailable: it is none of these, or cannot be read or downloaded.
    """
    local = Path(model).expanduser()
    if local.is_dir():
        folder = local.resolve()
        return ResolvedModel(folder, folder.name)
    if local.suffix == GGUF_SUFFIX:
        if not local.is_file():
            raise ModelUnavailable(f"model {model!r} not found: no such GGUF file")
        try:
            return ResolvedModel(gguf_checkpoint(local.resolve(), cache_dir), local.stem)
        except (ValueError, OSError) as exc:  # transformers' own messages may run over several lines
            raise ModelUnavailable(" ".join(str(exc).split())) from None
    if local.exists():
        raise ModelUnavailable(f"model {model!r} is a file, but neither a checkpoint folder nor a {GGUF_SUFFIX} file")
    return ResolvedModel(_hub_snapshot(model), model)


def _hub_snapshot(repo_id: str) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    try:
        huggingface_hub.utils.validate_repo_id(repo_id)
    except errors.HFValidationError:
        raise ModelUnavailable(
            f"model {repo_id!r} not found: no such folder or {GGUF_SUFFIX} file, nor a Hugging Face model name"
        ) from None
    offline = huggingface_hub.is_offline_mode()
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=HUB_FILE_PATTERNS, ignore_patterns=_HUB_IGNORED, local_files_only=offline
        )
    except errors.LocalEntryNotFoundError as exc:
        why = "downloads are off (HF_HUB_OFFLINE=1)" if offline else f"the Hub could not be reached ({_reason(exc)})"
        raise ModelUnavailable(
            f"model {repo_id!r} not found: no such folder, and not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) while {why}"
        ) from None
    except errors.RepositoryNotFoundError:  # gated and private repositories included
        raise ModelUnavailable(
            f"model {repo_id!r} not found: no such folder, nor a Hugging Face model this token may read"
        ) from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise ModelUnavailable(f"model {repo_id!r} could not be downloaded: {_reason(exc)}") from None
    return Path(folder).resolve()


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__

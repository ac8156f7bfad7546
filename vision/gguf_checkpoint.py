"""A GGUF file as a checkpoint folder: read by transformers' GGUF reader, dequantized, written once.

transformers reads a GGUF's config, tokenizer (chat template included) and weights, dequantizing every
tensor, but only through ``from_pretrained(..., gguf_file=...)`` and slowly (seconds of tokenizer
conversion, then the tensors). Converted once into a normal folder in the cache, the file is then served
by the code that serves any checkpoint, in every process that loads it, at the speed of safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from vision.written_once import written_once

__all__ = ["GGUF_SUFFIX", "convert_gguf", "gguf_checkpoint"]

GGUF_SUFFIX = ".gguf"
_MARKER = "GGUF_SOURCE"  # written last: a folder without it is not a finished conversion
_FORMAT_VERSION = "1"  # bump when the conversion below changes, so old folders are written again


def gguf_checkpoint(file: Path, cache_dir: Path) -> Path:
    """The checkpoint folder converted from the GGUF ``file``, written once into ``cache_dir``.

    The folder is keyed by the file's name, size and modification time (a changed file is converted
    again, without reading its gigabytes to hash them), and built aside and renamed in
    (``vision.written_once``).

    :raises ValueError: transformers cannot read the file, or not its architecture (the message names it).
    """
    stat = file.stat()
    source = {"file": file.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "version": _FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(cache_dir) / "gguf" / f"{file.stem}-{key}"

    def write(folder: Path) -> None:
        convert_gguf(file, folder)
        (folder / _MARKER).write_text(json.dumps(source) + "\n")

    return written_once(target, _MARKER, write)


def convert_gguf(file: Path, folder: Path) -> None:
    """Write the GGUF ``file`` into ``folder`` as config, fp32 safetensors, generation config and tokenizer.

    fp32 holds every dequantized value exactly; the engine casts to its serving dtype when it loads.

    :raises ValueError: transformers cannot read the file, or not its architecture, or the packages its
        GGUF reader needs are missing.
    """
    missing = [package for package in ("gguf", "accelerate") if importlib.util.find_spec(package) is None]
    if missing:
        raise ValueError(f"{file}: reading a GGUF file needs the {' and '.join(missing)} package (pip install)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = file.parent, file.name
    try:
        # the metadata alone first: an architecture transformers cannot read fails in milliseconds
        AutoConfig.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{file}: transformers cannot read this GGUF file: {_first_line(exc)}") from None
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    # every weight unpacked into plain layers, whatever GGUF kernels are installed: a plain model that
    # transformers saves (one it left in GGUF blocks it refuses to) and whose config names no GGUF
    dense = GgufConfig(gguf_file=name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, quantization_config=dense, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

"""Cache affinity for scale-out: which replica a request should go to, decided from its body alone.

A request's ``routing_key`` names the cache it most wants to find warm on a replica:

1. its first image's content (the encoder cache is keyed by image content),
2. else its constraint (the grammar cache is keyed by the canonical spec),
3. else the first ``PREFIX_CHARS`` characters of its prompt (the KV prefix cache).

Images come first because they spread: many requests share one schema or one system prompt, and
keyed by those, every one of them would land on one replica. ``HashRing`` maps keys onto replicas by
consistent hashing, so when a replica leaves or joins only its own share of the keys moves.

Nothing here imports Ray: the keys and the ring are tested on their own.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from typing import Any

import msgspec

from pipeline.protocol.constraints import CONSTRAINT_FIELDS

__all__ = ["PREFIX_CHARS", "HashRing", "routing_key"]

PREFIX_CHARS = 512
# constraint fields that say how to constrain, not what: they do not change the compiled grammar
_NOT_THE_GRAMMAR = frozenset({"guided_decoding_backend"})


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _first_image(messages: Any) -> str | None:
    """The URL of the first image part (a ``data:`` URL carries the content itself)."""
    if not isinstance(messages, list):
        return None
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str) and url:
                return url
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _prompt_prefix(doc: dict[str, Any]) -> str:
    messages = doc.get("messages")
    if isinstance(messages, list):
        prefix = "".join(f"{m.get('role', '')}:{_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    else:
        prompt = doc.get("prompt")  # /v1/completions: text, token ids, or a list of either
        if isinstance(prompt, str):
            prefix = prompt
        elif isinstance(prompt, list) and prompt:
            prefix = msgspec.json.encode(prompt).decode()
        else:
            prefix = ""
    return prefix[:PREFIX_CHARS]


def routing_key(body: bytes) -> str | None:
    """The key of the cache this request body most wants warm; None: any replica will do (a body
    that does not parse is routed anywhere, and the replica answers it with the usual 400)."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    url = _first_image(doc.get("messages"))
    if url is not None:
        return "image:" + _digest(url.encode())
    constraint = {k: doc[k] for k in sorted(CONSTRAINT_FIELDS & doc.keys() - _NOT_THE_GRAMMAR)}
    if constraint:
        return "constraint:" + _digest(msgspec.json.encode(constraint, order="sorted"))
    prefix = _prompt_prefix(doc)
    return "prefix:" + _digest(prefix.encode()) if prefix else None


class HashRing:
    """Consistent hashing: each node owns ``points`` spots on a ring of 64-bit hashes, and a key
    belongs to the first spot at or after its own hash. Removing a node moves only the keys it
    owned; the other nodes keep theirs."""

    def __init__(self, nodes: Iterable[str], points: int = 64) -> None:
        ring = sorted((self._hash(f"{node}#{i}"), node) for node in set(nodes) for i in range(points))
        self._hashes = [h for h, _ in ring]
        self._nodes = [n for _, n in ring]

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    def __len__(self) -> int:
        return len(set(self._nodes))

    def node(self, key: str) -> str:
        """The node that owns ``key``. :raises LookupError: the ring is empty."""
        if not self._nodes:
            raise LookupError("no nodes on the ring")
        i = bisect.bisect_left(self._hashes, self._hash(key))
        return self._nodes[i % len(self._nodes)]

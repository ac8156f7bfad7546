"""KV prefix cache keys: a hash chain over full blocks of tokens, images keyed by their content.

The key of block i hashes the key of block i - 1 and the block's token ids, so equal keys mean equal
prefixes, and the K/V of a block depends on nothing else. Image tokens all share one id; a block
holding some also hashes, for each image it overlaps, the image's content hash, its token grid and
which of its embedding rows fall in the block, so two different images never share KV. With M-RoPE
the positions of an image's tokens and of every token after it are a function of the tokens and the
grids before them, all of which the chain holds: equal keys mean equal positions too. A block with image tokens
of unknown content (an engine input without ``image_keys``) ends the chain: it and every block
after it are never shared.

BLAKE2b with a 128-bit digest: identity must not be forgeable across users, and it hashes a 64-byte
block in about a microsecond.
"""

from __future__ import annotations

import hashlib
from array import array

from sampling.image_spans import uncut_prefix
from sampling.kv_cache import BlockAllocator
from sampling.sequence import Sequence

__all__ = ["cacheable_prefix", "compute_block_hashes", "register_computed", "take_cached_prefix"]


def cacheable_prefix(num_tokens: int, block_size: int) -> int:
    """How many leading tokens a new sequence may take from the cache: whole blocks, and never its
    last token, whose logits it needs (so the block it writes first is always a fresh one)."""
    return (num_tokens - 1) // block_size * block_size


def compute_block_hashes(seq: Sequence, num_blocks: int, block_size: int, image_token_id: int | None) -> list[bytes]:
    """The keys of ``seq``'s first ``num_blocks`` full blocks (fewer where the chain ends), memoised
    on the sequence: its committed tokens never change, so neither do its keys."""
    hashes = seq.block_hashes
    while len(hashes) < num_blocks and not seq.is_chain_broken:
        start = len(hashes) * block_size
        end = start + block_size
        # slicing the prompt alone where it can: seq.tokens() joins prompt and outputs on every call
        tokens = seq.prompt_ids[start:end] if end <= len(seq.prompt_ids) else seq.tokens(start, end)
        if len(tokens) < block_size:
            break
        h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
        h.update(array("q", tokens).tobytes())
        in_prompt = tokens[: max(0, len(seq.prompt_ids) - start)]
        num_image = in_prompt.count(image_token_id) if image_token_id is not None else 0
        if num_image:
            if not _hash_images(h, seq, seq.num_hashed_image_rows, num_image):
                seq.is_chain_broken = True
                break
            seq.num_hashed_image_rows += num_image
        hashes.append(h.digest())
    return hashes[:num_blocks]


def _hash_images(h: hashlib.blake2b, seq: Sequence, first_row: int, num_rows: int) -> bool:
    """Feed ``h`` the identity of embedding rows ``[first_row, first_row + num_rows)``; False when
    the sequence's images are not keyed by content."""
    keys = seq.image_keys
    if sum(k.num_tokens for k in keys) < first_row + num_rows:
        return False
    end, row = first_row + num_rows, 0
    for key in keys:
        lo, hi = max(first_row, row), min(end, row + key.num_tokens)
        if lo < hi:
            # the grid too: M-RoPE positions (so the K/V) of the image and all after it depend on it
            h.update(f"{key.content_hash}:{key.grid_thw}:{lo - row}:{hi - row};".encode())
        row += key.num_tokens
    return True


def take_cached_prefix(
    allocator: BlockAllocator, seq: Sequence, block_size: int, image_token_id: int | None, atomic_image: int | None
) -> None:
    """Start ``seq`` after the longest run of its leading blocks found in the cache (with
    ``atomic_image``, an image token whose spans must not be split: cut back to before such a span)."""
    bs = block_size
    hashes = compute_block_hashes(seq, cacheable_prefix(seq.num_tokens, bs) // bs, bs, image_token_id)
    found = []
    for block_hash in hashes:
        block = allocator.lookup(block_hash)
        if block is None:
            break
        found.append(block)
    if atomic_image is not None:  # the prefill after the hit must not start inside an image span
        found = found[: uncut_prefix(seq.prompt_ids, atomic_image, len(found) * bs, bs) // bs]
    allocator.share(found)
    allocator.stats.hits += len(found)
    allocator.stats.misses += len(hashes) - len(found)
    seq.block_table = found
    seq.num_computed = seq.num_registered = len(found) * bs


def register_computed(allocator: BlockAllocator, seq: Sequence, block_size: int, image_token_id: int | None) -> None:
    """Register ``seq``'s full blocks whose K/V is computed (and whose tokens are committed)."""
    bs = block_size
    num_full = min(seq.num_computed, seq.num_tokens, len(seq.block_table) * bs) // bs
    if num_full <= seq.num_registered // bs:
        return
    hashes = compute_block_hashes(seq, num_full, bs, image_token_id)
    for i in range(seq.num_registered // bs, len(hashes)):
        allocator.register(seq.block_table[i], hashes[i])
    seq.num_registered = num_full * bs

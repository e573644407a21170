"""The prefix cache's block hash, one definition for the engine and for whoever reads its KV events.

A full block of `block_size` tokens is named by a 64-bit chain hash: the hash of its parent's hash and its
own token ids, so equal hashes mean equal prefixes. Published in KV events (``core.kv_events``) and
documented in docs/router.md, so a router computes the same numbers from a request's token ids:

    block_hash(parent, tokens) = first 8 bytes, big-endian, of
        SHA-256( parent as 8 bytes big-endian  ||  each token id as 4 bytes big-endian )

The first block's parent is the chain's root: 0 for the base model, ``lora_root(name)`` for a LoRA adapter
(an adapter's KV is never another's; the name, not a server's integer id, so every replica agrees).
"""

import hashlib
import struct

BASE_ROOT = 0


def block_hash(parent: int | None, tokens) -> int:
    data = struct.pack(f">Q{len(tokens)}I", BASE_ROOT if parent is None else parent, *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def lora_root(lora_name: str) -> int:
    """The root of an adapter's chains: first 8 bytes, big-endian, of SHA-256(b"lora\\x00" + name in UTF-8)."""
    return int.from_bytes(hashlib.sha256(b"lora\x00" + lora_name.encode()).digest()[:8], "big")


def chain_hashes(token_ids, block_size: int, root: int = BASE_ROOT) -> list[int]:
    """The hashes of every full block of token_ids, in order (what a router looks up)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes

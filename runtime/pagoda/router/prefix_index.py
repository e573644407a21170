"""An approximate picture of each backend's prefix cache, kept at the router from the requests it routed.

The engine's prefix cache hashes full token blocks as a chain (each block's hash covers every block before
it), so two prompts share cached blocks exactly as far as they share a prefix. The router has no tokenizer,
so it runs the same chain over fixed-size blocks of the prompt's text: a match of k text blocks means the
first k*BLOCK_CHARS characters were sent to that backend before, and so (unless evicted since) their tokens
sit in its cache. Each backend keeps its most recently used chain hashes, bounded (LRU), as the engine
evicts least-recently-used blocks too.

Across backends the index also keeps the forks of the chains: which different blocks followed a block. A
prefix that several requests continued differently (a system prompt that many conversations open with)
is a shared prefix, where a conversation's own history continues where its last request ended.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_CHARS = 64  # ~16 tokens of English text: the engine's default block size
MAX_BLOCKS_PER_BACKEND = 1 << 16  # ~4 M characters (~1 M tokens) remembered per backend
SHARED_AFTER = 2  # a prefix continued differently by this many earlier requests is a shared one
MAX_FORKS = 1 << 17  # blocks whose continuations are remembered (LRU)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """The hash chain over the text's full blocks (a trailing partial block is not cached by the engine)."""
    hashes, parent = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hash((parent, text[start:start + block_chars]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    def __init__(self, max_blocks_per_backend: int = MAX_BLOCKS_PER_BACKEND, max_forks: int = MAX_FORKS):
        self.max_blocks = max_blocks_per_backend
        self.blocks: dict[str, OrderedDict[int, None]] = {}
        self.max_forks = max_forks
        self.forks: OrderedDict[int, set[int]] = OrderedDict()  # block -> the blocks seen after it (a few)

    def match(self, url: str, hashes: list[int]) -> int:
        """How many leading blocks of the chain the backend is believed to hold."""
        held = self.blocks.get(url)
        if not held:
            return 0
        n = 0
        for h in hashes:  # chain hashes: the first miss ends the shared prefix
            if h not in held:
                break
            n += 1
        return n

    def insert(self, url: str, hashes: list[int]) -> None:
        held = self.blocks.setdefault(url, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
        for parent, child in zip(hashes, hashes[1:]):
            after = self.forks.setdefault(parent, set())
            if len(after) <= SHARED_AFTER:
                after.add(child)
            self.forks.move_to_end(parent)
        while len(self.forks) > self.max_forks:
            self.forks.popitem(last=False)

    def shared(self, hashes: list[int], n: int) -> bool:
        """Whether the chain's first n blocks are a shared prefix: at least SHARED_AFTER earlier requests
        continued it with other blocks than this chain's next (a conversation's later turn continues where
        its own last request ended, where nothing else did)."""
        if n == 0 or n >= len(hashes):
            return False
        return len(self.forks.get(hashes[n - 1], set()) - {hashes[n]}) >= SHARED_AFTER

    def forget(self, url: str) -> None:
        """A backend that left (or restarted: its cache is empty again)."""
        self.blocks.pop(url, None)

    def retain(self, urls: set[str]) -> None:
        for url in [u for u in self.blocks if u not in urls]:
            del self.blocks[url]

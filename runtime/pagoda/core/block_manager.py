"""The KV cache's bookkeeping: which fixed-size blocks each sequence owns. Pure Python, no torch.

- Free blocks wait in an LRU queue; a free block that still holds a full, hashed block of tokens
  stays findable by the prefix cache until it is taken for something else (evicted).
- Full blocks are identified by a chained hash (parent block's hash + this block's tokens), so a hit
  on block i implies the whole prefix up to i matches.
- Blocks are reference counted: prefix hits and forked sequences (n > 1) share them. A sequence about
  to write into a shared partial block first gets its own copy (copy-on-write); the copy is done by
  the model runner from the (src, dst) pairs returned here.
- Swap space: a second pool of host blocks. A preempted sequence's blocks can be swapped out (each to
  its own host block, shared or not) and swapped back in to fresh device blocks; the runner does the
  copies from the (device, host) / (host, device) pairs returned here.
- KV events (``kv_events``): when ``events`` is set, each change of the prefix cache (a block hashed, a cached
  block evicted, the cache reset, hashed blocks swapped out and dropped from swap) is told to it as it happens.
- Sliding window (``kv_window``): when every layer slides, the blocks wholly behind a sequence's window are
  released before each allocation; their table entries become NULL_BLOCK and own nothing. A prefix hit
  then needs only its last window's blocks cached (the lookup searches from the end).
- KV cache groups (``kv_cache_groups``): a model mixing full and windowed layers gets one BlockManager per group,
  sharing one pool (``pool``): the free queue, reference counts, prefix-cache map and swap blocks. A group other
  than the first keys its cached blocks by (group, hash): the same tokens are other blocks in each group.
"""

from collections import OrderedDict

from pagoda.core.block_hash import block_hash, lora_root
from pagoda.core.kv_window import NULL_BLOCK, num_blocks_behind_window
from pagoda.core.sequence import Sequence

__all__ = ["BlockManager", "block_hash", "chain_root"]


def chain_root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: its LoRA adapter's (one adapter's KV is never another's)."""
    return None if seq.lora_request is None else lora_root(seq.lora_request.lora_name)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, sliding_window: int | None = None,
                 pool: "BlockManager | None" = None, group: int = 0):
        """sliding_window: the window behind which blocks are dropped (``kv_window.droppable_window``), or
        None to keep every block of a sequence while it lives. pool: another group's manager whose blocks this
        one shares (``kv_cache_groups``); group: this manager's index among them (0 publishes KV events)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = LRU
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        self.seq_hashes: dict[int, list[int]] = {}  # seq id -> hashes of its full blocks, in order
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))  # pop() takes the lowest
        self.swap_tables: dict[int, list[int]] = {}  # seq id -> host block ids, in table order
        self.events = None  # a kv_events.KVEventRecorder, or None (no events)
        self.swap_hashes: dict[int, list[int]] = {}  # with events: seq id -> hashes its host blocks hold
        self.num_evicted_blocks = 0  # cached blocks taken for other tokens (a counter; resets are not evictions)
        self.freed_in = [0] * num_blocks  # block -> the free() call that last freed it (_take_free_block's runs)
        self.free_calls = [0]  # free() calls so far (a list: shared with the other groups' managers)
        self.group = group
        if pool is not None:  # one pool of blocks under every group's tables
            self.ref_counts, self.hash_of_block, self.free_queue = pool.ref_counts, pool.hash_of_block, pool.free_queue
            self.cached_blocks, self.free_swap_blocks = pool.cached_blocks, pool.free_swap_blocks
            self.freed_in, self.free_calls = pool.freed_in, pool.free_calls

    def _key(self, h: int):
        """The prefix-cache key of a block hash in this group (the hash itself in the first group)."""
        return h if self.group == 0 else (self.group, h)

    @property
    def _publishes(self) -> bool:
        """KV events tell the first group's blocks only (the others' keys are no chain hashes a router knows)."""
        return self.events is not None and self.group == 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_used_swap_blocks(self) -> int:
        return self.num_swap_blocks - len(self.free_swap_blocks)

    def swap_usage(self) -> float:
        return self.num_used_swap_blocks / self.num_swap_blocks if self.num_swap_blocks else 0.0

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables.get(seq.seq_id, [])

    def group_block_ids(self, seq: Sequence, start: int) -> None:
        """Other KV cache groups' tables: none here, one table serves every layer (see kv_cache_groups)."""
        return None

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq's tokens. The last token is never a hit:
        its logits are needed, so at least one token is always computed. With a droppable window only the
        blocks the next query's window reaches need to be cached: the entries before them are NULL_BLOCK."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent, hits = chain_root(seq), []
        if self.sliding_window is not None:
            hashes = []
            for i in range((seq.num_tokens - 1) // bs):
                parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                hashes.append(parent)
            return self._find_window_hit(hashes)
        for i in range((seq.num_tokens - 1) // bs):
            h = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            block = self.cached_blocks.get(self._key(h))
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def find_cached_prefix_within(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The longest hit of at most num_blocks blocks (``kv_cache_groups``: every group's hit must agree). With
        a window that is not a prefix of the longest hit: the shorter hit needs its own window's blocks cached."""
        if self.sliding_window is None:
            return self.find_cached_prefix(seq)[:num_blocks]
        bs, parent, hashes = self.block_size, chain_root(seq), []
        for i in range(min((seq.num_tokens - 1) // bs, num_blocks)):
            parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        return self._find_window_hit(hashes) if self.enable_prefix_caching else []

    def _find_window_hit(self, hashes: list[int]) -> list[int]:
        """The longest hit of h blocks whose blocks from ``num_blocks_behind_window(h * block_size)`` to h are
        all cached, searched from the end (as vLLM's sliding-window manager): the blocks a sequence freed
        behind its window, or that were evicted since, do not stop a hit on its last window's blocks."""
        hits = [NULL_BLOCK] * len(hashes)
        top = None  # the last block of the run of cached blocks the scan is in
        for i in range(len(hashes) - 1, -1, -1):
            block = self.cached_blocks.get(self._key(hashes[i]))
            if block is None:
                top = None
                continue
            hits[i] = block
            top = i if top is None else top
            if i <= num_blocks_behind_window((top + 1) * self.block_size, self.sliding_window, self.block_size):
                return hits[: top + 1]  # (the entries before i stay NULL_BLOCK)
        return []

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None,
                 keep_free: int = 0) -> list[tuple[int, int]] | None:
        """Give seq slots for its next num_new_tokens tokens (after `cached` prefix blocks on its first
        allocation). Returns the copy-on-write (src, dst) pairs, or None, changing nothing (but blocks
        behind the window, released first), if the free blocks do not suffice with `keep_free` of them left."""
        plan = self.plan_allocation(seq, num_new_tokens, cached)
        table, taken, num_needed, write_index, copy_on_write, num_computed, num_free_needed = plan
        if num_free_needed + keep_free > len(self.free_queue):
            if not table:
                del self.tables[seq.seq_id]
            return None
        return self.commit_allocation(seq, num_new_tokens, plan)

    def plan_allocation(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> tuple:
        """What allocate would do, changing nothing but releasing the blocks behind the window: a tuple for
        commit_allocation whose last item is the number of free blocks it takes."""
        cached = cached or []
        bs = self.block_size
        table = self.tables.setdefault(seq.seq_id, [])
        num_computed = seq.num_computed_tokens + len(cached) * bs
        behind = num_blocks_behind_window(num_computed, self.sliding_window, bs)
        self._release_behind_window(table, behind)  # no query of this step or later reads them
        num_needed = -(-(num_computed + num_new_tokens) // bs) - len(table) - len(cached)
        write_index = num_computed // bs
        copy_on_write = write_index < len(table) and self.ref_counts[table[write_index]] > 1
        # cached blocks behind the window are not taken: their entries are NULL_BLOCK from the start
        taken = [NULL_BLOCK if len(table) + i < behind else b for i, b in enumerate(cached)]
        revived = sum(1 for b in taken if b != NULL_BLOCK and self.ref_counts[b] == 0)
        return (table, taken, num_needed, write_index, copy_on_write, num_computed,
                max(num_needed, 0) + copy_on_write + revived)

    def commit_allocation(self, seq: Sequence, num_new_tokens: int, plan: tuple) -> list[tuple[int, int]]:
        """Carry out plan_allocation's plan (the free blocks must suffice); returns the copy-on-write pairs."""
        self.take_cached_blocks(plan)
        return self.take_new_blocks(seq, num_new_tokens, plan)

    def take_cached_blocks(self, plan: tuple) -> None:
        """A plan's first half: the prefix hit's blocks join the table (before any group takes free blocks, which
        could evict them)."""
        table, taken = plan[0], plan[1]
        for block in taken:
            if block != NULL_BLOCK:
                if self.ref_counts[block] == 0:
                    del self.free_queue[block]
                self.ref_counts[block] += 1
            table.append(block)

    def take_new_blocks(self, seq: Sequence, num_new_tokens: int, plan: tuple) -> list[tuple[int, int]]:
        """A plan's second half: copy-on-write and the new blocks; returns the copy-on-write pairs."""
        table, _, num_needed, write_index, copy_on_write, num_computed, _ = plan
        copies = []
        if copy_on_write:
            shared = table[write_index]
            own = self._take_free_block()
            self.ref_counts[shared] -= 1
            table[write_index] = own
            copies.append((shared, own))
        for i in range(num_needed):
            last = table[-1] if table and table[-1] != NULL_BLOCK else None
            table.append(self._take_free_block(follow=last, run=num_needed - i))
        if self.enable_prefix_caching:  # draft tokens (past the sequence's own) are not cached
            self._register_full_blocks(seq, table, min(num_computed + num_new_tokens, seq.num_tokens))
        return copies

    def _release_behind_window(self, table: list[int], behind: int) -> None:
        """Release the table's first `behind` blocks (those already NULL_BLOCK form a leading run: the scan
        stops at the first)."""
        for i in range(min(behind, len(table)) - 1, -1, -1):
            block = table[i]
            if block == NULL_BLOCK:
                break
            table[i] = NULL_BLOCK
            self._unref(block)

    def _unref(self, block: int) -> None:
        """One holder fewer; a block nobody holds joins the free queue's tail (still findable by its hash)."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            self.freed_in[block] = self.free_calls[0]

    def _take_free_block(self, follow: int | None = None, run: int = 1) -> int:
        """A free block for a table whose last block is `follow` (None: a new table), `run` blocks of it to take.

        The attention kernels read a context's blocks in table order: consecutive blocks stream, a jump waits on
        memory (docs/kernels.md). Taken in the free queue's order alone (a sequence's blocks freed tail first,
        the decodes' blocks taken one at a time in turn), a served pool's contexts drift to runs of ~1-3 blocks.
        So: the block after `follow` when it is free and cold: it caches nothing, or it was freed in the older
        half of the free history (between the oldest free block's free() and now); cached blocks freed since
        stay for prefix hits, as in a plain LRU. Else the least recently used block, moved down to where its run
        starts among the blocks the same free() released (at most `run` - 1 lower), so that the next blocks can
        follow it. (On the Xeon with AMX, after a few hundred mixed requests: runs of ~1-3 -> ~11-17 blocks, a
        step of 24 decodes over 1,024-token prompts 65 -> 55-60 ms; prefix hit rates 0.668 -> 0.658 on shared
        documents, 0.478 -> 0.455 on returning chats. Taking the block after however recently freed made runs
        of ~35 blocks but cost the documents' hits 0.668 -> 0.593.)"""
        block = next(iter(self.free_queue))
        after = None if follow is None else follow + 1
        if after in self.free_queue and (self.hash_of_block[after] is None or
                                         2 * self.freed_in[after] <= self.freed_in[block] + self.free_calls[0]):
            block = after
        else:
            for _ in range(run - 1):
                if block - 1 not in self.free_queue or self.freed_in[block - 1] != self.freed_in[block]:
                    break
                block -= 1
        del self.free_queue[block]
        h = self.hash_of_block[block]
        if h is not None:  # evict it from the prefix cache
            if self.cached_blocks.get(h) == block:
                del self.cached_blocks[h]
                self.num_evicted_blocks += 1
                if self.events is not None and isinstance(h, int):  # (a first-group block, whichever group takes it)
                    self.events.removed([h])
            self.hash_of_block[block] = None
        self.ref_counts[block] = 1
        return block

    def _register_full_blocks(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Hash the blocks that this step fills, so later requests can reuse them. Their KV is
        written in this step's forward pass before any other sequence's attention reads it."""
        bs = self.block_size
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        first = len(hashes)
        stored = [] if self._publishes else None  # indexes of the blocks this call made findable
        for i in range(first, num_tokens // bs):
            parent = hashes[-1] if hashes else chain_root(seq)
            h = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            hashes.append(h)
            block, key = table[i], self._key(h)
            if block != NULL_BLOCK and key not in self.cached_blocks and self.hash_of_block[block] is None:
                self.cached_blocks[key] = block
                self.hash_of_block[block] = key
                if stored is not None:
                    stored.append(i)
        if stored:
            self._tell_stored(seq, hashes, stored)

    def _tell_stored(self, seq: Sequence, hashes: list[int], indexes: list[int], medium: str = "GPU") -> None:
        """One BlockStored per run of consecutive blocks (a chain: each names its parent)."""
        bs, start = self.block_size, 0
        for k in range(1, len(indexes) + 1):
            if k == len(indexes) or indexes[k] != indexes[k - 1] + 1:
                lo, hi = indexes[start], indexes[k - 1] + 1
                self.events.stored(hashes[lo:hi], hashes[lo - 1] if lo > 0 else None,
                                   list(seq.token_ids[lo * bs : hi * bs]), seq.lora_request, medium)
                start = k

    def release_slots_after(self, seq: Sequence, num_tokens: int) -> None:
        """Keep seq's blocks for its first num_tokens tokens, free the rest (the slots of rejected
        speculative drafts: private, never hashed)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            block = table.pop()
            if block != NULL_BLOCK:
                self._unref(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (copy-on-write later)."""
        table = list(self.tables[parent.seq_id])
        for block in table:
            if block != NULL_BLOCK:
                self.ref_counts[block] += 1
        self.tables[child.seq_id] = table
        self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, []))

    # --- swap space ---------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        held = sum(1 for b in self.tables.get(seq.seq_id, []) if b != NULL_BLOCK)
        return 0 < held <= len(self.free_swap_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to host blocks (call can_swap_out first): its device blocks are released
        (a shared one stays with its other holders) and the (device, host) copies are returned. Entries
        behind the window stay NULL_BLOCK in the host table."""
        table = self.tables[seq.seq_id]
        host = [NULL_BLOCK if b == NULL_BLOCK else self.free_swap_blocks.pop() for b in table]
        self.swap_tables[seq.seq_id] = host
        if self._publishes:  # the host copies of its hashed (full) blocks
            hashes = self.seq_hashes.get(seq.seq_id, [])
            held = [i for i in range(min(len(hashes), len(table))) if table[i] != NULL_BLOCK]
            self.swap_hashes[seq.seq_id] = [hashes[i] for i in held]
            if held:
                self._tell_stored(seq, hashes, held, "CPU")
        pairs = [(b, h) for b, h in zip(table, host) if b != NULL_BLOCK]
        self.free(seq, keep_swapped=True)
        return pairs

    def swap_in(self, seq: Sequence, num_new_tokens: int, keep_free: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out seq back to fresh device blocks with room for its next num_new_tokens
        tokens. Returns the (host, device) copies, or None, changing nothing, if the blocks do not suffice with
        `keep_free` of them left."""
        if self.swap_in_blocks_needed(seq, num_new_tokens) + keep_free > len(self.free_queue):
            return None
        host = self.swap_tables[seq.seq_id]
        held = [h for h in host if h != NULL_BLOCK]
        table = [NULL_BLOCK if h == NULL_BLOCK else self._take_free_block() for h in host]
        self.tables[seq.seq_id] = table
        del self.swap_tables[seq.seq_id]
        self._drop_swap_hashes(seq)
        self.free_swap_blocks.extend(reversed(held))
        pairs = [(h, b) for h, b in zip(host, table) if h != NULL_BLOCK]
        self.allocate(seq, num_new_tokens)  # cannot fail: counted above; registers the blocks' hashes too
        return pairs

    def swap_in_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """The free device blocks swap_in takes: one per held host block, and the new ones for num_new_tokens."""
        host = self.swap_tables[seq.seq_id]
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return sum(1 for h in host if h != NULL_BLOCK) + max(num_needed - len(host), 0)

    def free(self, seq: Sequence, keep_swapped: bool = False) -> None:
        if not keep_swapped:
            host = self.swap_tables.pop(seq.seq_id, [])
            self.free_swap_blocks.extend(h for h in reversed(host) if h != NULL_BLOCK)
            self._drop_swap_hashes(seq)
        table = self.tables.pop(seq.seq_id, [])
        self.seq_hashes.pop(seq.seq_id, None)
        self.free_calls[0] += 1
        # tail blocks first: they are the least likely to be shared, so they are evicted first
        for block in reversed(table):
            if block != NULL_BLOCK:
                self._unref(block)

    def _drop_swap_hashes(self, seq: Sequence) -> None:
        hashes = self.swap_hashes.pop(seq.seq_id, None)
        if hashes and self.events is not None:
            self.events.removed(hashes, "CPU")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (as vLLM's reset_prefix_cache): only when no sequence holds a block,
        device or host (so AllBlocksCleared means all); False, changing nothing, otherwise."""
        if self.num_used_blocks or self.swap_tables:
            return False
        self.cached_blocks.clear()
        self.hash_of_block[:] = [None] * self.num_blocks  # (in place: other groups share it)
        if self.events is not None:
            self.events.cleared()
        return True

    def check_no_leaks(self) -> None:
        """With no live sequences, every block is free (possibly cached and evictable), device and host."""
        leaked = [b for b, refs in enumerate(self.ref_counts) if refs != 0]
        if self.tables or leaked or len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"KV blocks leaked: tables={list(self.tables)}, referenced={leaked[:10]}, "
                                 f"free={len(self.free_queue)}/{self.num_blocks}")
        if (self.swap_tables or len(self.free_swap_blocks) != self.num_swap_blocks
                or len(set(self.free_swap_blocks)) != self.num_swap_blocks):
            raise AssertionError(f"swap blocks leaked: swap tables={list(self.swap_tables)}, "
                                 f"free={len(self.free_swap_blocks)}/{self.num_swap_blocks}")

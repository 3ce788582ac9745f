"""A paged KV block manager, as vLLM's: fixed-size blocks, one block table per sequence.

Pure bookkeeping with no time in it, so the no-leak invariant can be property-tested.
:class:`KVBlockManager` caches nothing; :class:`PrefixCachingKVBlockManager` adds vLLM V1's
automatic prefix caching (ref-counted blocks, a hash -> block map, an LRU free queue).
"""

from __future__ import annotations

from collections import OrderedDict

from serving.engine.prefix import prompt_block_hashes


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``tokens`` tokens (rounded up)."""
    return -(-tokens // block_size)


class KVBlockManager:
    """Hands out block ids from a free list; ``used + free == total`` at all times."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self.live_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq_id: str, new_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to grow by ``new_tokens``."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for(self._tokens.get(seq_id, 0) + new_tokens, self.block_size) - have)

    def append(self, seq_id: str, new_tokens: int) -> bool:
        """Grow ``seq_id`` by ``new_tokens`` slots (allocating it if new); False if out of blocks.

        On False nothing changes, so the caller can preempt and try again.
        """
        if new_tokens < 0:
            raise ValueError("new_tokens must be >= 0")
        need = self.blocks_needed(seq_id, new_tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        free = self._free
        for _ in range(need):
            table.append(free.pop())
        self._tokens[seq_id] = self._tokens.get(seq_id, 0) + new_tokens
        self.live_tokens += new_tokens
        return True

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id``; returns how many. Freeing twice is a no-op."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self.live_tokens -= self._tokens.pop(seq_id)
        self._free.extend(table)
        return len(table)

    def prompt_hashes(self, prompt: str, prompt_tokens: int) -> list[int] | None:
        """The prompt's block names for a prefix lookup; None: this pool caches no prefixes."""
        return None

    def lookup(self, hashes: list[int], max_tokens: int) -> int:
        """Blocks of the longest cached prefix of ``hashes``: none, as nothing is cached here."""
        return 0

    def admit(
        self,
        seq_id: str,
        hashes: list[int],
        hit: int,
        new_tokens: int,
        *,
        query_tokens: int,
        preempted: bool,
    ) -> bool:
        """Start ``seq_id`` on its ``hit`` cached blocks and grow it by ``new_tokens``.

        Without a cache there is no hit, so this is :meth:`append`.
        """
        return self.append(seq_id, new_tokens)

    def tokens(self, seq_id: str) -> int:
        return self._tokens.get(seq_id, 0)

    def holders(self) -> list[str]:
        return list(self._tables)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of ``seq_id``'s block ids, in token order (empty if it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def check(self) -> None:
        """Assert the invariants: no block lost, none owned twice, counts consistent."""
        owned = [b for t in self._tables.values() for b in t]
        everything = owned + self._free
        if len(everything) != self.num_blocks or set(everything) != set(range(self.num_blocks)):
            raise AssertionError("KV blocks leaked or double-owned")
        if self.live_tokens != sum(self._tokens.values()):
            raise AssertionError("live token count drifted")
        for seq, table in self._tables.items():
            if len(table) != blocks_for(self._tokens[seq], self.block_size):
                raise AssertionError(f"{seq} holds {len(table)} blocks for {self._tokens[seq]}")


class PrefixCachingKVBlockManager(KVBlockManager):
    """vLLM V1's automatic prefix caching over the same tables: blocks are shared, not copied.

    Each block has a ref count and, once its prompt content is computed, a name (a chained hash,
    :mod:`serving.engine.prefix`) under which a later request finds it. Blocks no sequence
    holds wait in an LRU free queue, still findable; a fresh block is the queue's head, and
    taking it evicts its name. A sequence's blocks are queued tail first when it ends, so its
    last blocks are evicted before its first ones, which more prompts share (vLLM's order).
    ``used + free == total`` still holds, a cached free block counting as free, as vLLM counts.
    ``live_tokens`` counts each held block's tokens once, however many sequences share it.

    Queries and hits are counted in tokens at each admission, as vLLM's Prometheus counters
    count them; a lookup on re-admission after preemption goes to ``preempted_queries`` and
    ``preempted_hits`` instead (vLLM 0.29 keeps those apart and does not export them).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._free.clear()  # the LRU queue below is this pool's free list
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self._named: dict[str, int] = {}
        self.preempted_queries = 0
        self.preempted_hits = 0

    @property
    def free_blocks(self) -> int:
        return len(self._queue)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._queue)

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by name, held or free."""
        return len(self._cached)

    def prompt_hashes(self, prompt: str, prompt_tokens: int) -> list[int] | None:
        return prompt_block_hashes(prompt, prompt_tokens, self.block_size)

    def lookup(self, hashes: list[int], max_tokens: int) -> int:
        """Blocks of the longest cached prefix of ``hashes``, at most ``max_tokens`` worth."""
        cached = self._cached
        limit = min(len(hashes), max_tokens // self.block_size)
        hit = 0
        while hit < limit and hashes[hit] in cached:
            hit += 1
        return hit

    def admit(
        self,
        seq_id: str,
        hashes: list[int],
        hit: int,
        new_tokens: int,
        *,
        query_tokens: int,
        preempted: bool,
    ) -> bool:
        """Take the first ``hit`` blocks of ``hashes`` from the cache, then ``new_tokens`` slots.

        All or nothing: on False (not enough free blocks once the hit blocks leave the free
        queue) nothing changes and nothing is counted. ``seq_id`` must hold nothing yet.
        """
        if seq_id in self._tables:
            raise ValueError(f"{seq_id} already holds blocks")
        blocks = [self._cached[h] for h in hashes[:hit]]
        refs = self._refs
        revived = sum(1 for b in blocks if refs[b] == 0)
        need = blocks_for(hit * self.block_size + new_tokens, self.block_size) - hit
        if need > len(self._queue) - revived:
            return False
        for b in blocks:
            if refs[b] == 0:
                del self._queue[b]
                self.live_tokens += self.block_size
            refs[b] += 1
        self._tables[seq_id] = blocks
        self._tokens[seq_id] = hit * self.block_size
        self._named[seq_id] = hit
        if hit < len(hashes):
            self._hashes[seq_id] = hashes
        if preempted:
            self.preempted_queries += query_tokens
            self.preempted_hits += hit * self.block_size
        else:
            self.prefix_cache_queries += query_tokens
            self.prefix_cache_hits += hit * self.block_size
        return self.append(seq_id, new_tokens)

    def append(self, seq_id: str, new_tokens: int) -> bool:
        """Grow ``seq_id`` by ``new_tokens`` slots; name the prompt blocks this fills.

        A block is findable from the step that computes it, as in vLLM (each layer writes its
        KV before attending). A fresh block is the free queue's head, its old name evicted. On
        False nothing changes. Runs for every sequence every step, so it is written inline.
        """
        if new_tokens < 0:
            raise ValueError("new_tokens must be >= 0")
        tables = self._tables
        table = tables.get(seq_id)
        tokens = self._tokens.get(seq_id, 0) + new_tokens
        need = -(-tokens // self.block_size) - (len(table) if table is not None else 0)
        queue = self._queue
        if need > len(queue):
            return False
        if table is None:
            table = tables[seq_id] = []
        if need > 0:
            refs = self._refs
            names = self._block_hash
            pop = queue.popitem
            for _ in range(need):
                block = pop(False)[0]
                refs[block] = 1
                name = names[block]
                if name is not None:
                    names[block] = None
                    del self._cached[name]
                table.append(block)
        self._tokens[seq_id] = tokens
        self.live_tokens += new_tokens
        hashes = self._hashes.get(seq_id)
        if hashes is not None:
            self._name_full_blocks(seq_id, table, hashes)
        return True

    def _name_full_blocks(self, seq_id: str, table: list[int], hashes: list[int]) -> None:
        """Name the newly full prompt blocks; a name another block holds stays with that block."""
        full = min(self._tokens[seq_id] // self.block_size, len(hashes))
        cached = self._cached
        for i in range(self._named[seq_id], full):
            name = hashes[i]
            if name not in cached:
                cached[name] = table[i]
                self._block_hash[table[i]] = name
        self._named[seq_id] = full
        if full == len(hashes):
            del self._hashes[seq_id]

    def free(self, seq_id: str) -> int:
        """Drop ``seq_id``'s hold on its blocks; those no one holds join the free queue, still
        cached, last block first. Returns how many blocks it held; freeing twice is a no-op."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        tokens = self._tokens.pop(seq_id)
        self._hashes.pop(seq_id, None)
        self._named.pop(seq_id, None)
        refs = self._refs
        queue = self._queue
        kept = 0
        for block in reversed(table):
            left = refs[block] - 1
            refs[block] = left
            if left:
                kept += 1
            else:
                queue[block] = None
        self.live_tokens -= tokens - kept * self.block_size  # a block still held is full
        return len(table)

    def check(self) -> None:
        """Assert the invariants: every block held or free (never both), ref counts match the
        tables, a block shared by several sequences is a named one, names map both ways."""
        holders = [0] * self.num_blocks
        held_tokens: dict[int, int] = {}
        size = self.block_size
        for seq, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{seq} holds a block twice")
            if len(table) != blocks_for(self._tokens[seq], size):
                raise AssertionError(f"{seq} holds {len(table)} blocks for {self._tokens[seq]}")
            for i, b in enumerate(table):
                holders[b] += 1
                held_tokens[b] = min(size, self._tokens[seq] - i * size)
        if holders != self._refs:
            raise AssertionError("ref counts differ from the block tables")
        free = [b for b in range(self.num_blocks) if holders[b] == 0]
        if sorted(self._queue) != free:
            raise AssertionError("KV blocks leaked, or a held block is in the free queue")
        names = self._block_hash
        if any(holders[b] > 1 and names[b] is None for b in range(self.num_blocks)):
            raise AssertionError("an unnamed block is shared")
        named = {b: h for b, h in enumerate(names) if h is not None}
        if {b: h for h, b in self._cached.items()} != named:
            raise AssertionError("the name -> block map and the block names disagree")
        if self.live_tokens != sum(held_tokens.values()):
            raise AssertionError("live token count drifted")

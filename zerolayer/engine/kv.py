"""A paged KV block manager, as vLLM's: fixed-size blocks, one block table per sequence.

Pure bookkeeping with no time in it, so the no-leak invariant can be property-tested.
"""

from __future__ import annotations


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

    def tokens(self, seq_id: str) -> int:
        return self._tokens.get(seq_id, 0)

    def holders(self) -> list[str]:
        return list(self._tables)

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

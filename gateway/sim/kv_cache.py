"""The simulated engine's paged KV cache and prefix cache (pure; after vLLM v1's
``kv_cache_manager.py`` and ``block_pool.py``), used by :class:`gateway.sim.engine.Engine`.

* Paged KV cache of ``kv_cache_tokens // block_size`` blocks. A running request holds
  ``ceil((prompt + generated + 1) / block_size)`` blocks (when growth does not fit, the
  engine preempts).
* Prefix cache. Full prompt blocks carry chained hashes (hash of parent hash + block
  tokens, salted by ``cache_salt`` such as a LoRA name). Blocks whose reference count
  drops to zero stay cached in an LRU of free blocks and are evicted only when a fresh
  block is needed. A lookup may hit at most ``prompt_tokens - 1`` tokens (vLLM always
  recomputes the last prompt token), rounded down to whole blocks. Counters are in
  tokens, as vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
  Only prompt blocks are hashed; generated-token blocks are private.
* KV usage (0-1) is ``used_blocks / total_blocks``; cached-but-free blocks count as
  free, as in vLLM's ``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence


def _salt_hash(salt: str) -> int:
    return zlib.crc32(salt.encode("utf-8"))


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``.

    Each hash covers its parent hash and the block's tokens (vLLM's
    ``hash_block_tokens``), so equal hashes mean equal prefixes. Deterministic across
    processes (integer-tuple hashing does not depend on ``PYTHONHASHSEED``).
    """
    parent = _salt_hash(salt)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Counts KV blocks; keeps ref counts of hashed blocks and an LRU of free cached ones."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.used = 0  # blocks held by requests (hashed or private)
        self.refs: dict[int, int] = {}  # hash -> ref count (> 0), blocks in use
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: first = oldest

    @property
    def free(self) -> int:
        """Blocks not held by any request (cached-free blocks count as free)."""
        return self.num_blocks - self.used

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Number of leading ``hashes`` present in the cache, at most ``max_blocks``."""
        n = 0
        for h in hashes[:max_blocks]:
            if h in self.refs or h in self.cached_free:
                n += 1
            else:
                break
        return n

    def can_allocate(self, hit_hashes: Sequence[int], new_blocks: int) -> bool:
        """Whether ``new_blocks`` fresh blocks fit once ``hit_hashes`` are reused."""
        revived = sum(1 for h in hit_hashes if h in self.cached_free)
        return new_blocks + revived <= self.free

    def take_hit(self, h: int) -> None:
        """Hold the cached block ``h`` once more (reviving it from the free LRU)."""
        if h in self.cached_free:
            del self.cached_free[h]
            self.used += 1
        self.refs[h] = self.refs.get(h, 0) + 1

    def allocate_fresh(self, n: int) -> None:
        """Take ``n`` fresh blocks, evicting the least recently freed cached blocks."""
        for _ in range(n):
            if self.num_blocks - self.used - len(self.cached_free) <= 0:
                self.cached_free.popitem(last=False)
            self.used += 1

    def register(self, h: int) -> bool:
        """Give a just-computed fresh block the hash ``h``; False if ``h`` already cached."""
        if h in self.refs or h in self.cached_free:
            return False
        self.refs[h] = 1
        return True

    def release_hashed(self, h: int) -> None:
        """Drop one hold of block ``h``; at zero it stays cached in the free LRU."""
        n = self.refs[h] - 1
        if n:
            self.refs[h] = n
        else:
            del self.refs[h]
            self.cached_free[h] = None
            self.used -= 1

    def release_private(self, n: int) -> None:
        """Free ``n`` private (unhashed) blocks."""
        self.used -= n

    def reset(self) -> None:
        """Forget every cached free block (``/reset_prefix_cache``)."""
        self.cached_free.clear()

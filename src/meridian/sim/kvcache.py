"""The fast engine's KV cache: vLLM's block pool with prefix caching, as its scheduler sees it.

What matters to scheduling, modelled after vLLM v1 (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``):

- A fixed pool of blocks; one of them is vLLM's null block, so ``num_blocks - 1`` are usable.
- A free queue: allocation takes blocks from its front. A freed block whose content is cached
  (a full block with a hash) goes to the back, least recently freed first out (LRU); a freed
  block without a hash goes to the front (reused first). A request's blocks are freed tail
  first, so its later blocks leave the cache before its earlier ones.
- Prefix caching: a full block is cached once its tokens are computed. A cached block keeps its
  content while it sits in the free queue, until allocation takes it. A request admitted (or
  re-admitted after a preemption) first takes back the longest run of its own leading blocks
  still cached (at most ``num_tokens - 1`` tokens: the last token is always computed), and
  computes only the rest. Prompts are unique per request, so only a request's own blocks
  match (no sharing between requests).

Invariant (``check_integrity``): every usable block is either in the free queue or held by
exactly one request; a cached key maps to the block that holds it and back.
"""

from __future__ import annotations

from collections import OrderedDict

from meridian.errors import MeridianError

_Key = tuple[str, int]  # (request id, block index): a request's own block content


class KvCacheError(MeridianError):
    """A block operation the pool cannot honour (a bug in the caller)."""


class PrefixCachingBlockPool:
    """vLLM's block pool for one full-attention KV cache group (module docstring).

    >>> pool = PrefixCachingBlockPool(num_blocks=5, block_size=4)
    >>> pool.num_free_blocks
    4
    >>> pool.allocate("a", 2); pool.cache("a", num_computed_tokens=8); pool.free("a")
    >>> pool.num_cached_prefix_tokens("a", num_tokens=9)
    8
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size < 1:
            raise KvCacheError(
                f"a block pool needs >= 2 blocks (one is vLLM's null block) and block_size >= 1; "
                f"got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.num_usable_blocks = num_blocks - 1
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_usable_blocks))
        self._held: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a live request already cached
        self._key_of: dict[int, _Key] = {}
        self._block_of: dict[_Key, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can take (cached content in the free queue counts as free)."""
        return len(self._free)

    def num_held(self, request_id: str) -> int:
        """Blocks ``request_id`` holds."""
        return len(self._held.get(request_id, ()))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_blocks: int) -> None:
        """Give ``request_id`` ``num_blocks`` blocks from the front of the free queue."""
        if num_blocks > len(self._free):
            raise KvCacheError(f"cannot allocate {num_blocks} blocks; {len(self._free)} are free")
        held = self._held.setdefault(request_id, [])
        free, key_of, block_of = self._free, self._key_of, self._block_of
        for _ in range(num_blocks):
            block, _ = free.popitem(last=False)
            key = key_of.pop(block, None)
            if key is not None:
                del block_of[key]  # its cached content is evicted
            held.append(block)

    def cache(self, request_id: str, num_computed_tokens: int) -> None:
        """Cache every full block of ``request_id`` whose tokens are computed."""
        held = self._held.get(request_id)
        if held is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(held))
        start = self._num_cached.get(request_id, 0)
        key_of, block_of = self._key_of, self._block_of
        for index in range(start, num_full):
            block, key = held[index], (request_id, index)
            stale = block_of.get(key)
            if stale is not None and stale != block:
                # The same content computed again in another block (re-allocated without
                # taking its cached copy back): the new block holds it; the old one is plain free.
                del key_of[stale]
            key_of[block] = key
            block_of[key] = block
        if num_full > start:
            self._num_cached[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release every block of ``request_id``: cached ones to the back (tail first), the
        rest to the front. Its cached content stays until allocation takes those blocks."""
        held = self._held.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if held is None:
            return
        free, key_of = self._free, self._key_of
        for block in reversed(held):
            free[block] = None
            if block not in key_of:
                free.move_to_end(block, last=False)

    def num_cached_prefix_tokens(self, request_id: str, num_tokens: int) -> int:
        """Tokens of ``request_id``'s leading blocks still cached (a prefix-cache hit), at most
        ``num_tokens - 1``."""
        max_blocks = (num_tokens - 1) // self.block_size
        block_of = self._block_of
        hits = 0
        while hits < max_blocks and (request_id, hits) in block_of:
            hits += 1
        return hits * self.block_size

    def take_cached_prefix(self, request_id: str, num_hit_tokens: int) -> None:
        """Give ``request_id`` back its cached leading blocks (out of the free queue)."""
        if self._held.get(request_id):
            raise KvCacheError(f"request {request_id!r} already holds blocks")
        num_blocks = num_hit_tokens // self.block_size
        held: list[int] = []
        for index in range(num_blocks):
            block = self._block_of[(request_id, index)]
            del self._free[block]
            held.append(block)
        if held:
            self._held[request_id] = held
            self._num_cached[request_id] = num_blocks

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        seen = set(self._free)
        for request_id, held in self._held.items():
            for block in held:
                if block in seen:
                    raise AssertionError(f"block {block} of {request_id!r} is also elsewhere")
                seen.add(block)
        if seen != set(range(self.num_usable_blocks)):
            raise AssertionError("a block is neither free nor held")
        for key, block in self._block_of.items():
            if self._key_of.get(block) != key:
                raise AssertionError(f"cached key {key} and block {block} disagree")
        if len(self._key_of) != len(self._block_of):
            raise AssertionError("cache maps differ in size")

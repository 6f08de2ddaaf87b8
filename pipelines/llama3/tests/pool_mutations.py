"""Planted block-pool bugs (pipelines/llama3/serving.py's `BlockPool`) that only a pool under
pressure reaches: no lane that never evicts, or never shares a block between running sequences,
can find them. The schedule fuzz (test_fuzz_serving.py) and the golden lanes' `pressure`
scenario (max_tests/.../mutations.py, SERVING_MUTATIONS) each must fail them.
"""

from __future__ import annotations

from pipelines.llama3.serving import BlockPool, ServingEngine


class EvictionKeepsTheHash(BlockPool):
    """Eviction reuses the least recently used cached block but leaves its hash findable."""

    def allocate(self):
        if self.free or not self.evictable:
            return super().allocate()
        block, _ = self.evictable.popitem(last=False)
        self.hash_of.pop(block)  # the cache's entry for it stays
        self.refs[block] = 1
        return block

    def lookup(self, key):
        block = self.cached.get(key)
        if block is not None and self.refs[block] == 0 and block not in self.evictable:
            self.free.remove(block)  # the stale entry's block, freed since: taken as a hit
            self.refs[block] = 1
            self.hits += 1
            return block
        return super().lookup(key)


class UncountedHit(BlockPool):
    """A cache hit on a block someone already reads does not count the new reader."""

    def lookup(self, key):
        block = self.cached.get(key)
        if block is not None and self.refs[block] > 0:
            self.hits += 1
            return block
        return super().lookup(key)


class ShortWholePromptCopy(ServingEngine):
    """A prompt found whole in the cache gets one position fewer of its last block copied:
    the position before its last keeps whatever its new block held."""

    def _copy_positions(self, source: int, copy: int, count: int) -> None:
        super()._copy_positions(source, copy, count - 1)


def serving_with(pool_class: type[BlockPool]) -> type[ServingEngine]:
    """ServingEngine whose block pool is a `pool_class` (its `_new_pool` seam)."""

    def _new_pool(self, num_blocks: int) -> BlockPool:
        return pool_class(self.engine, num_blocks, self.block_size)

    return type(f"ServingWith{pool_class.__name__}", (ServingEngine,), {"_new_pool": _new_pool})

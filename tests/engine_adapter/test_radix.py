"""The simulator's radix cache evicts least recently used unlocked leaves, as SGLang's does.

Eviction reads its candidates from a heap kept as the tree changes (``engine_adapter/sim/
radix.py``), so a leaf the heap lost would never be evicted: the engine's cache would fill with
unlocked tokens and requests would wait for memory forever. Random operation sequences check,
against a walk of the whole tree after every step, that the counts are right, that every call
frees what it was asked to when that much is unlocked, and that nothing it freed was used more
recently than what it left.
"""

from __future__ import annotations

import random

import pytest

from engine_adapter.sim.radix import Node, RadixCache


def walk(cache: RadixCache) -> list[Node]:
    out, stack = [], list(cache._roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            out.append(node)
    return out


def unlocked_leaves(nodes: list[Node]) -> list[Node]:
    return [n for n in nodes if not n.children and not n.lock_ref]


@pytest.mark.parametrize("seed", range(6))
def test_eviction_is_lru_over_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    cache = RadixCache(capacity_tokens=10**9)
    locks: list[Node] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(20)]
    evicted_total = 0
    for _ in range(3000):
        op = rng.random()
        ns = rng.choice(("a", "b", ("embedding", rng.randrange(3))))
        ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        if op < 0.45:
            node, _ = cache.insert(ns, ids)
            if rng.random() < 0.3:
                cache.lock(node)
                locks.append(node)
        elif op < 0.65:
            cache.match_prefix(ns, ids[: rng.randrange(1, len(ids) + 1)])
        elif op < 0.8 and locks:
            cache.unlock(locks.pop(rng.randrange(len(locks))))
        else:
            before = walk(cache)
            evictable = sum(len(n.key) for n in before if not n.lock_ref)
            asked = rng.randrange(1, 40)
            freed = cache.evict(asked)
            after = walk(cache)
            gone = set(map(id, before)) - set(map(id, after))
            assert sum(len(n.key) for n in before if id(n) in gone) == freed
            assert freed >= min(asked, evictable), "an unlocked leaf was not found"
            left = unlocked_leaves(after)
            if gone and left:
                newest_gone = max(n.last_access for n in before if id(n) in gone)
                assert newest_gone <= min(n.last_access for n in left)
            assert not any(n.lock_ref for n in before if id(n) in gone)
            evicted_total += freed
        nodes = walk(cache)
        assert cache.nodes == len(nodes)
        assert cache.tree_tokens == sum(len(n.key) for n in nodes)
        assert cache.locked_tokens == sum(len(n.key) for n in nodes if n.lock_ref)
    assert evicted_total > 0
    assert cache.evicted_tokens == evicted_total


def test_full_cache_evicts_everything_unlocked_and_nothing_locked() -> None:
    cache = RadixCache(capacity_tokens=100)
    kept, _ = cache.insert("a", [1, 2, 3, 4])
    cache.lock(kept)
    for i in range(500):
        cache.insert("b", [9, i % 7, i])
    unlocked = cache.tree_tokens - 4
    assert unlocked == 1 + 7 + 500  # [9], then [i % 7], then [i]
    assert cache.evict(10**6) == unlocked
    assert [len(n.key) for n in walk(cache)] == [4]
    cache.unlock(kept)
    assert cache.evict(10**6) == 4
    assert cache.tree_tokens == 0

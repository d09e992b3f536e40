"""A real radix prefix cache with token capacity and LRU eviction, like SGLang's RadixCache.

The platform's router, cost-to-serve attribution and billing of cached tokens all depend on
how a prefix cache behaves: hits for shared prefixes, none across tenants (cache namespaces),
and evictions under memory pressure. A counter or a dict of prompts would make those tests
pass against behaviour no engine has, so the simulator keeps the same structure SGLang does:
one radix tree of token ids per namespace, nodes split on partial matches, nodes locked while a
request uses them, and least-recently-used unlocked leaves evicted when capacity runs out.
Capacity is shared by every namespace, as KV memory is on a GPU.

Eviction picks leaves from a heap kept as the tree changes (a leaf made, touched, unlocked or
left bare by its last child pushes an entry; stale ones are skipped when popped), not from a
walk of the whole tree per call: with the cache full every admitted request evicts, and the
walk grew with the tree (tens of thousands of nodes after a batch's unique prompts) until it
was a third of a simulated engine's CPU and stalled its event loop for milliseconds at a time,
a cost the simulated engine's time model knows nothing of (bench/batch_interference.py's
interactive p99 tripled with batch lines beside it). Which leaves go is the same LRU order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Namespace = Hashable


@dataclass(eq=False)
class Node:
    """One edge of the tree: ``key`` is the run of token ids from the parent to this node."""

    key: list[int]
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    """Token-id prefix tree per namespace, with a shared token capacity."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._roots: dict[Namespace, Node] = {}
        self._clock = itertools.count(1)
        self.tree_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0
        self.nodes = 0  # non-root nodes in the tree
        # (last_access, tie, node) for every unlocked leaf, plus stale entries skipped on pop
        self._leaves: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()

    @property
    def evictable_tokens(self) -> int:
        """Tokens held by the tree that no running request uses."""
        return self.tree_tokens - self.locked_tokens

    @property
    def namespaces(self) -> int:
        """Number of namespaces that hold at least one token."""
        return sum(1 for root in self._roots.values() if root.children)

    def _root(self, namespace: Namespace) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(key=[], parent=None, lock_ref=1)
        return root

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` so its first ``at`` tokens become a new parent; return that parent."""
        assert node.parent is not None  # noqa: S101 - roots are never split
        head = Node(
            key=node.key[:at],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        self.nodes += 1
        node.parent.children[head.key[0]] = head
        node.key = node.key[at:]
        node.parent = head
        head.children[node.key[0]] = node
        return head

    def match_prefix(self, namespace: Namespace, ids: Sequence[int]) -> tuple[int, Node]:
        """Return the length of the longest cached prefix of ``ids`` and its last node."""
        node = self._root(namespace)
        now = next(self._clock)
        node.last_access = now
        i = 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            common = 0
            limit = min(len(child.key), len(ids) - i)
            while common < limit and child.key[common] == ids[i + common]:
                common += 1
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node = child
            i += common
        self._candidate(node)
        return i, node

    def insert(self, namespace: Namespace, ids: Sequence[int]) -> tuple[Node, int]:
        """Insert ``ids``; return the node ending the path and how many tokens were new."""
        matched, node = self.match_prefix(namespace, ids)
        added = len(ids) - matched
        if added:
            leaf = Node(key=list(ids[matched:]), parent=node, last_access=node.last_access)
            node.children[leaf.key[0]] = leaf
            self.tree_tokens += added
            self.nodes += 1
            self._candidate(leaf)
            node = leaf
        return node, added

    def lock(self, node: Node) -> None:
        """Pin the path from ``node`` to its root so eviction skips it."""
        current: Node | None = node
        while current is not None and current.parent is not None:
            if current.lock_ref == 0:
                self.locked_tokens += len(current.key)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: Node) -> None:
        """Release one pin taken by :meth:`lock`."""
        current: Node | None = node
        while current is not None and current.parent is not None:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self.locked_tokens -= len(current.key)
            current = current.parent
        self._candidate(node)

    def _candidate(self, node: Node) -> None:
        """Push ``node`` as an eviction candidate if it is an unlocked leaf (now, at its
        current access time); rebuild the heap when stale entries outnumber the tree."""
        if node.parent is None or node.children or node.lock_ref:
            return
        heapq.heappush(self._leaves, (node.last_access, next(self._tie), node))
        if len(self._leaves) > 2 * self.nodes + 1024:
            live: list[Node] = []
            stack = list(self._roots.values())
            while stack:
                current = stack.pop()
                stack.extend(current.children.values())
                if current.parent is not None and not current.children and not current.lock_ref:
                    live.append(current)
            self._leaves = [(n.last_access, next(self._tie), n) for n in live]
            heapq.heapify(self._leaves)

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used unlocked leaves until ``num_tokens`` are freed."""
        heap = self._leaves
        freed = 0
        while freed < num_tokens and heap:
            access, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if (parent is None or leaf.children or leaf.lock_ref
                    or access != leaf.last_access):
                continue  # stale: evicted, no longer a leaf, locked, or touched since
            del parent.children[leaf.key[0]]
            leaf.parent = None  # detached: its other entries are stale
            freed += len(leaf.key)
            self.tree_tokens -= len(leaf.key)
            self.nodes -= 1
            self._candidate(parent)
        self.evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry (what ``/flush_cache`` does when the engine is idle)."""
        self._roots.clear()
        self._leaves.clear()
        self.tree_tokens = 0
        self.locked_tokens = 0
        self.nodes = 0

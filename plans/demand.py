"""How busy one thing (a quota policy, an organization) is in one process: its requests counted
in windows of ``WINDOW_S``, the level being the larger of this window's count and the last's.
At ``BUSY`` a process stops asking Redis about each request and takes a share ahead: a quota
lease (``plans.admission.lease``) or a pool of in-flight slots (``plans.concurrency``)."""

from __future__ import annotations

BUSY = 4
WINDOW_S = 0.1


class Demand:
    """Requests counted in the current window and the one before it."""

    __slots__ = ("count", "prev", "since")

    def __init__(self) -> None:
        self.since = 0.0
        self.count = self.prev = 0

    def add(self, now: float) -> None:
        """Count one request arriving at ``now`` (``time.monotonic()``)."""
        if now - self.since >= WINDOW_S:
            self.prev = self.count if now - self.since < 2 * WINDOW_S else 0
            self.since, self.count = now, 0
        self.count += 1

    @property
    def level(self) -> int:
        """Requests within one window: this one's so far, or the last one's if more."""
        return max(self.count, self.prev)

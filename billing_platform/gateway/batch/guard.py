"""How much of the engines a batch may fill: a scavenger guarded by interactive latency.

A fixed share (1/16 of each engine's slots) kept interactive TTFT safe on a shared 2-core host
but made a batch crawl on an idle fleet, where nothing needs the other 15/16. The share is now
steered by what interactive requests actually get, the TTFT the gateways publish per model
(``gateway/ttft_signal.py``), read at every probe of the runner (``PROBE_EVERY_S``):

- no interactive request for ``TOLLGATE_BATCH_IDLE_S``: the fleet is idle, batch may fill every
  slot but ``TOLLGATE_BATCH_FREE_SLOTS`` per engine (kept for the first interactive arrivals);
- interactive traffic (again): the share falls to the floor (``TOLLGATE_BATCH_MAX_RUNNING_
  FRACTION``) at once, and the TTFT measured there is the baseline;
- then AIMD: each step of ``TOLLGATE_BATCH_GROW_FRACTION`` of the slots is judged on the TTFT
  of requests that started after it (a full ``TOLLGATE_BATCH_TTFT_WINDOW_S`` and at least
  ``TOLLGATE_BATCH_TTFT_MIN_SAMPLES`` requests): the next step is taken only when it stayed
  within ``TOLLGATE_BATCH_TTFT_TOLERANCE`` of the baseline, in both the mean TTFT (which the
  slow requests, the p99's, weigh in) and the geometric mean (a typical request's, the p50's;
  a few slow requests swing the mean of a short window more than batch does);
- the share falls back to the floor within one probe when the last window's TTFT rises past
  that, when any engine queues, when the host's CPUs were busier than
  ``TOLLGATE_BATCH_HOST_CPU_CEILING`` (others' use, under interactive traffic only), or when the
  signal cannot be read.

The host-CPU check stays as a leading indicator beside the lagging TTFT one: where gateway,
engines and worker share the cores, a busy host is interference before the TTFT window says so.
On an idle fleet it no longer applies: there is no interactive request to protect, and on a
shared host it held batch back for work that was not ours (or batch's own engine load).

The baseline follows TTFT down whatever the share (a window faster than it proves the baseline
too high) and up only at the floor (more interactive load is not batch's fault); so a baseline
learned under lighter load cannot let batch take more than it should. The state is one per model
per worker process and outlives a slice: the next slice of a batch starts where the last ended.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.conf import settings

from billing_platform.gateway.ttft_signal import SLOT_S, Slot
from engine_adapter.types import EngineLoad

BASELINE_WEIGHT = 0.3  # how much one judged window moves the baseline (an EWMA)


@dataclass
class Window:
    """Interactive requests over some slots, their mean TTFT (ms: the slow ones weigh in it)
    and their geometric mean TTFT (ms: a typical request's)."""

    requests: int = 0
    mean_ms: float = 0.0
    typical_ms: float = 0.0

    @classmethod
    def of(cls, slots: Iterable[Slot]) -> Window:
        n, total, logs = 0, 0.0, 0.0
        for slot in slots:
            n += slot.requests
            total += slot.sum_ms
            logs += slot.sum_ln
        return cls(n, total / n, math.exp(logs / n)) if n else cls()

    def over(self, baseline: Window, tolerance: float) -> bool:
        """Return whether either TTFT is more than ``tolerance`` above the baseline's."""
        return (self.mean_ms > baseline.mean_ms * (1 + tolerance)
                or self.typical_ms > baseline.typical_ms * (1 + tolerance))

    def toward(self, other: Window, weight: float, *, down_only: bool) -> None:
        """Move each TTFT ``weight`` of the way to ``other``'s (only down: ``down_only``)."""
        for name in ("mean_ms", "typical_ms"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if not down_only or theirs < mine:
                setattr(self, name, mine + weight * (theirs - mine))


@dataclass
class Scavenger:
    """The share of the engines' slots batch lines may fill, steered per probe (``decide``)."""

    floor: float
    step: float
    tolerance: float
    idle_s: float
    window_s: float
    min_samples: int
    cpu_ceiling: float
    fraction: float = 0.0
    baseline: Window | None = None  # interactive TTFT with batch at the floor
    idle: bool = False
    changed_at: float = 0.0  # when ``fraction`` last changed (wall clock, as the signal's)
    dropped_at: float = 0.0  # when it last fell to the floor
    reason: str = ""  # what the last decision was (``host_cpu``: start nothing at all)
    counts: dict[str, int] = field(default_factory=dict)  # probes per reason, for the log

    def __post_init__(self) -> None:
        self.fraction = self.floor

    @classmethod
    def from_settings(cls) -> Scavenger:
        return cls(floor=settings.BATCH_MAX_RUNNING_FRACTION,
                   step=settings.BATCH_GROW_FRACTION,
                   tolerance=settings.BATCH_TTFT_TOLERANCE, idle_s=settings.BATCH_IDLE_S,
                   window_s=settings.BATCH_TTFT_WINDOW_S,
                   min_samples=settings.BATCH_TTFT_MIN_SAMPLES,
                   cpu_ceiling=settings.BATCH_HOST_CPU_CEILING)

    @property
    def lookback_s(self) -> float:
        """How much of the signal ``decide`` needs."""
        return max(self.idle_s, 2 * self.window_s) + SLOT_S

    def _to(self, fraction: float, now: float, why: str) -> float:
        self.reason = why
        self.counts[why] = self.counts.get(why, 0) + 1
        fraction = max(self.floor, min(1.0, fraction))
        if fraction != self.fraction:
            self.fraction, self.changed_at = fraction, now
        return self.fraction

    def _drop(self, now: float, why: str) -> float:
        """Fall to the floor; what was measured before now judges nothing after it."""
        self.changed_at = self.dropped_at = now
        return self._to(self.floor, now, why)

    def traffic(self, slots: list[Slot], now: float) -> bool:
        """Return whether interactive requests reached the model within ``idle_s``."""
        return any(s.requests for s in slots if s.start + SLOT_S > now - self.idle_s)

    def decide(self, slots: list[Slot] | None, *, queued: bool, host_busy: float | None = None,
               now: float | None = None) -> float:
        """Return the share of slots batch may fill now, from the signal's last
        ``lookback_s`` (None: it could not be read), whether any engine queues, and the share
        of the host's CPUs others kept busy (None: not read)."""
        now = time.time() if now is None else now
        if slots is None:
            return self._drop(now, "no_signal")
        if not self.traffic(slots, now):
            self.idle = True
            return self._to(1.0, now, "idle")
        if self.idle:
            # interactive requests are back: what they met at the idle share is no baseline
            self.idle = False
            return self._drop(now, "arrival")
        if queued:
            return self._drop(now, "queued")
        if host_busy is not None and host_busy >= self.cpu_ceiling:
            return self._drop(now, "host_cpu")
        # the last window, but none of what it measured before the last fall to the floor
        last = Window.of(s for s in slots if s.start >= max(now - self.window_s,
                                                            self.dropped_at))
        if self.baseline is not None and last.requests and last.over(self.baseline,
                                                                     self.tolerance):
            return self._drop(now, "ttft")
        # the current share, judged on requests that started after it was set
        judged_slots = [s for s in slots if s.start >= self.changed_at]
        judged = Window.of(judged_slots)
        if (judged.requests < self.min_samples or not judged_slots
                or now - judged_slots[0].start < self.window_s):
            return self._to(self.fraction, now, "judging")
        if self.baseline is None:
            self.baseline = judged
        else:
            self.baseline.toward(judged, BASELINE_WEIGHT, down_only=self.fraction > self.floor)
        if judged.over(self.baseline, self.tolerance):
            return self._drop(now, "ttft")
        return self._to(self.fraction + self.step, now, "grow")


def batch_share(loads: Iterable[EngineLoad | None], *, fraction: float, floor: float,
                free_slots: int, ours: int, default_max_running: int = 64) -> int:
    """Return how many lines of one runner may be in flight on these engines now.

    Each engine without a queue offers ``fraction`` of its slots, but never the last
    ``free_slots`` (they wait for interactive arrivals) and never less than the floor's (at
    least one slot); an engine that queues, or whose load is unknown, offers nothing. What the
    engines run besides this runner's own ``ours`` (interactive requests, other batches'
    lines) counts against the offer, so runners together stay within it.
    """
    offer = running = 0
    for load in loads:
        if load is None or load.queued > 0:
            continue
        slots = load.max_running or default_max_running
        least = load.low_priority_slots(fraction=floor, default_max_running=slots)
        offer += max(least, min(int(slots * fraction), slots - free_slots))
        running += load.running
    return max(0, offer - max(0, running - ours))


class HostCpu:
    """How busy this machine's CPUs were between two readings, this process's own use left out.

    Where gateway, engines and batch worker share a machine, every CPU-second a batch line
    costs (in the engine, PostgreSQL, this worker) is taken from interactive requests once
    the cores are busy, whatever the engines' slots say; SCHED_IDLE only orders this worker
    itself. Reads /proc/stat (Linux): elsewhere, and on a first reading, ``busy`` is None.
    """

    MIN_WINDOW_S = 0.1  # a shorter window is a few clock ticks: it says nothing

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._read()

    def _read(self) -> tuple[float, int, int, float] | None:
        try:
            with open(self.path, "rb") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        own = os.times()
        # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
        return time.monotonic(), sum(ticks), ticks[3] + ticks[4], own.user + own.system

    async def abusy(self) -> float | None:
        """Return ``busy()`` once the window is long enough to say something (a slice's
        first probe waits out the rest of MIN_WINDOW_S rather than start lines blind).

        None only where there is nothing to read. A timer may fire a little early (uvloop
        counts in whole milliseconds), and a window a hair short of MIN_WINDOW_S said None,
        which the runner took as "no reading": it started lines on a host whose every core
        was busy. The window is waited out until it says something."""
        for _ in range(100):  # ~0.2 s at most past the window: /proc/stat ticks every 10 ms
            if self.last is None:
                break
            await asyncio.sleep(max(0.0, self.last[0] + self.MIN_WINDOW_S - time.monotonic())
                                + 0.002)
            if (busy := self.busy()) is not None:
                return busy
        return self.busy()

    def busy(self) -> float | None:
        """Return the share of all CPUs others kept busy since the last answer (0..1), or
        None: no /proc/stat, or a window too short to say (it then goes on)."""
        now, last = self._read(), self.last
        if now is None or last is None:
            self.last = now
            return None
        if now[0] - last[0] < self.MIN_WINDOW_S or now[1] <= last[1]:
            return None  # the window goes on
        self.last = now
        cpu_s = (now[1] - last[1]) / self.hz
        others = ((now[1] - last[1]) - (now[2] - last[2])) / self.hz - (now[3] - last[3])
        return min(1.0, max(0.0, others / cpu_s))


_scavengers: dict[str, Scavenger] = {}


def scavenger_for(model: str) -> Scavenger:
    """Return this process's guard of ``model``'s batch share (made from the settings)."""
    guard = _scavengers.get(model)
    if guard is None:
        guard = _scavengers[model] = Scavenger.from_settings()
    return guard


def scavengers_forget() -> None:
    """Forget every model's guard state (a test, or settings changed in this process)."""
    _scavengers.clear()

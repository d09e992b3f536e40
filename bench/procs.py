"""Process measurements several benchmarks share (stdlib only: import at any time)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """Return the user + system CPU the processes (not their children) have used."""
    return sum(process_cpu_seconds(proc.pid) for proc in procs)


def process_cpu_seconds(pid: int | str) -> float:
    """Return one process's user + system CPU so far (0 when it is gone)."""
    return (_ticks(pid) or 0) / os.sysconf("SC_CLK_TCK")


def _ticks(pid: int | str) -> int | None:
    """Return a process's user + system CPU in clock ticks, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def machine_busy_seconds() -> float:
    """Return the CPU time every core of the machine has spent busy (not idle or in I/O wait)
    since boot, from ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU spent while it runs, machine-wide and by the servers' processes.

    ``with CpuMeter() as meter: ...`` then ``meter.machine_s`` and ``meter.by_name`` (CPU
    seconds of the processes named ``postgres``, every one of the server's: backends, WAL
    writer, checkpointer...; and ``redis-server``). They are sampled every ``every_s`` from a
    thread: a process that starts inside counts from zero, one that exits inside counts until
    its last sample (so stop what you measure before leaving).
    """

    def __init__(self, names: tuple[str, ...] = ("postgres", "redis-server"),
                 every_s: float = 0.25) -> None:
        import threading

        self.names = names
        self.every_s = every_s
        self.machine_s = 0.0
        self.by_name: dict[str, float] = dict.fromkeys(names, 0.0)
        self._first: dict[str, int] = {}
        self._last: dict[str, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def _sample(self, *, initial: bool = False) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                name = Path(f"/proc/{entry.name}/comm").read_text().strip()
            except OSError:
                continue
            if name not in self.names or (ticks := _ticks(entry.name)) is None:
                continue
            self._first.setdefault(entry.name, ticks if initial else 0)
            self._last[entry.name] = (name, ticks)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample(initial=True)
        self._machine0 = machine_busy_seconds()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.machine_s = machine_busy_seconds() - self._machine0
        tick = os.sysconf("SC_CLK_TCK")
        for pid, (name, ticks) in self._last.items():
            self.by_name[name] += (ticks - self._first[pid]) / tick

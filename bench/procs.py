"""Process measurements several benchmarks share (stdlib only: import at any time)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """Return the user + system CPU the processes (not their children) have used."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for proc in procs:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total

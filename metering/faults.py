"""Fault injection for the ingest fault tests: stall at a named point so a test can SIGKILL.

``TOLLGATE_INGEST_STALL_AT=<point>:<n>`` makes the n-th pass through ``point`` print
``STALLED <point> <n>`` and sleep until the process is killed. Points: ``before_commit``
(the batch is written, its transaction still open) and ``after_commit`` (committed, not yet
acknowledged on the stream). Unset, each point costs one dictionary lookup.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from billing_platform import env

_POINT, _, _NTH = env.INGEST_STALL_AT.partition(":")
_passes: Counter[str] = Counter()


def point(name: str) -> None:
    """Mark a point of the ingest path; stall there when the environment asks for it."""
    if not _POINT or name != _POINT:
        return
    _passes[name] += 1
    if _passes[name] == int(_NTH or 1):
        sys.stdout.write(f"STALLED {name} {_passes[name]}\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)

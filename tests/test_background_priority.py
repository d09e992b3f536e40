"""The batch worker's CPU priority (devstack.background_priority), as ``./tollgate up`` and
bench/batch_interference.py start it: only CPU that nothing else wants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from billing_platform.devstack import background_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """No Redis here."""


def _sleeper(**popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            preexec_fn=background_priority, **popen)


def test_a_worker_in_its_own_session_is_idle_priority_in_a_nice_19_session_group():
    # given a worker started as the launchers start it (a session of its own)
    proc = _sleeper(start_new_session=True)
    try:
        # then it runs at SCHED_IDLE, and where the kernel groups CPU time by session its
        # group is niced too: otherwise the group's fair share is the worker's to take
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-2:] == ["nice", "19"]
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_sharing_its_callers_session_leaves_the_session_group_alone():
    group = Path("/proc/self/autogroup")
    if not group.exists():
        pytest.skip("no session autogroups on this kernel")
    before = group.read_text()
    proc = _sleeper()
    try:
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert Path(f"/proc/{proc.pid}/autogroup").read_text() == before
    finally:
        proc.kill()
        proc.wait()

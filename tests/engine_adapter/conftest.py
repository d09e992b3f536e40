"""Fixtures that run the engine simulator as a real process on a free port.

Tests talk to it over real HTTP (STYLE.md: stand-ins speak the real wire protocol), so each
fixture starts ``python -m engine_adapter.sim`` through the reusable ``start_sim`` helper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine_adapter.sim.testing import FAST_RATES, SimProcess, start_sim


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    """A fast simulator shared by the tests of one module (use unique prompts)."""
    with start_sim(served_model_name="sim-fast", max_running_requests=8, **FAST_RATES) as proc:
        yield proc


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., SimProcess]]:
    """Start simulators with custom flags; all are stopped after the test."""
    started: list[SimProcess] = []

    def factory(**flags: object) -> SimProcess:
        proc = start_sim(**flags)
        started.append(proc)
        return proc

    yield factory
    for proc in started:
        proc.stop()

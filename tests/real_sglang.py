"""Start real SGLang on this CPU (the set-up recipe's tiny model) for one test or module.

Every test against the real engine needs the same steps: a free port, the recipe's launch
line, a process group of its own (SGLang forks a scheduler and a detokenizer), a wait until
``/health`` answers that fails fast when the server dies, and a stop of the whole group;
``gateway_on_real_sglang`` puts a live gateway in front of it, for the tests that call it
through the official SDK.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from engine_adapter.sglang_cpu import launch_spec, resolve_paths, wait_healthy
from engine_adapter.sim.testing import free_port

PORT_ATTEMPTS = 3  # SGLang binds its port ~30 s after start-up: another process may take it


def _stop(server: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)


@contextmanager
def real_sglang(log_path: Path, *, served_model_name: str, extra_args: Sequence[str] = (),
                timeout: float = 240) -> Iterator[str]:
    """Run one real SGLang server and yield its base URL; it logs to ``log_path``.

    A server that dies or is not healthy in ``timeout`` seconds fails the test with the end of
    its log, unless it died because its port was taken meanwhile (SGLang binds it only once
    its tokenizer is up): then it starts again on another port, a few times. However the
    block ends, the server's process group is stopped.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        argv, env = launch_spec(model_dir=resolve_paths().model_dir, port=port,
                                served_model_name=served_model_name, extra_args=extra_args)
        with log_path.open("w") as out:
            server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, timeout=timeout,
                         is_alive=lambda s=server: s.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            _stop(server)
            log = log_path.read_text(errors="replace")
            if "address already in use" in log and attempt < PORT_ATTEMPTS:
                continue
            pytest.fail(f"{exc}\n{log[-3000:]}")
        break
    try:
        yield base_url
    finally:
        _stop(server)


@dataclass
class RealEngine:
    """What ``register_engine`` needs to know of an engine."""

    base_url: str
    model: str


@contextmanager
def gateway_on_real_sglang(tmp_path: Path, env: dict[str, str], *, model: str,
                           extra_args: Sequence[str] = ()) -> Iterator[openai.OpenAI]:
    """Run real SGLang serving ``model`` (us-east) behind a live gateway; yield an ``openai``
    client with a fresh key of a new organization. The caller prices the model."""
    from tests.gateway.conftest import register_engine, start_gateway, stop_gateway
    from tests.gateway.test_openai_api import _key

    with real_sglang(tmp_path / "sglang.log", served_model_name=model,
                     extra_args=extra_args) as base_url:
        gateway = None
        try:
            register_engine(RealEngine(base_url, model), pool="real-us",  # type: ignore[arg-type]
                            region="us-east", zone="us")
            gateway = start_gateway(tmp_path, env=env)
            _key_obj, secret = _key()
            yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)
        finally:
            if gateway is not None:
                stop_gateway(gateway)


@contextmanager
def side_by_side(log_dir: Path, *, model: str, extra_args: Sequence[str] = (),
                 **sim_options: Any) -> Iterator[dict[str, str]]:
    """Run real SGLang and the simulator serving ``model`` alike (``sim_options`` are the
    simulator's words for ``extra_args``); yield their base URLs by kind, "sglang" and
    "sim", for conformance tests that send both the same requests."""
    from engine_adapter.sim.testing import FAST_RATES, start_sim

    sim = start_sim(served_model_name=model, **{**FAST_RATES, **sim_options})
    try:
        with real_sglang(log_dir / "sglang.log", served_model_name=model,
                         extra_args=extra_args) as url:
            yield {"sglang": url, "sim": sim.base_url}
    finally:
        sim.stop()

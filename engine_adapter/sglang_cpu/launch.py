"""The one command line and environment that start real SGLang on a CPU.

The fleet launcher, the tests and the demo all start CPU engines through :func:`launch_spec`,
so the flags that make SGLang work without a GPU (native torch attention and sampling, no
overlap scheduler, the ``sgl_kernel`` shim on ``PYTHONPATH``) are written down once, next to
the recipe that builds the venv they run in. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from engine_adapter.sglang_cpu.recipe import SglangPaths, resolve_paths

# What the platform relies on (usage with cached tokens, Prometheus metrics, priorities), plus
# what a CPU needs. A later flag in ``extra_args`` overrides one of these (argparse keeps the
# last value), e.g. ``("--max-running-requests", "1")``.
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--enable-cache-report",
    "--enable-metrics",
    "--enable-priority-scheduling",
    "--default-priority-value", "0",
    "--max-total-tokens", "8192",
    "--context-length", "2048",
)  # fmt: skip

# Variables of the caller's environment that must not leak into the engine's interpreter.
_DROPPED_ENV = frozenset({"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE"})


def launch_spec(
    *,
    model_dir: Path | str,
    port: int,
    served_model_name: str,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    root: Path | str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Return the argv and the full environment that start one SGLang server on a CPU."""
    paths: SglangPaths = resolve_paths(root)
    argv = [
        str(paths.python), "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        *CPU_SERVER_ARGS,
        *extra_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(
        {
            "PYTHONPATH": str(paths.shim),
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return argv, env


def wait_healthy(
    base_url: str, *, timeout: float = 120.0, is_alive: Callable[[], bool] | None = None
) -> float:
    """Poll ``GET /health`` until it answers 200 and return the seconds waited.

    ``is_alive``, if given, is a callable returning False once the server process has died,
    so a crash fails fast instead of waiting out the timeout.
    """
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if is_alive is not None and not is_alive():
            raise RuntimeError(f"SGLang at {base_url} exited before it became healthy")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:  # noqa: S310
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"SGLang at {base_url} was not healthy after {timeout:.0f}s")


def get_json(url: str, *, timeout: float = 10.0) -> object:
    """Return the decoded JSON body of ``GET url`` (a small helper for checks and tests)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read())

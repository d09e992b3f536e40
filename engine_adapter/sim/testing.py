"""Start simulated engines as real subprocesses, for this project's tests and benchmarks.

Tests must exercise the real wire protocol over real sockets (STYLE.md: stand-ins speak the
real protocol), so the simulator runs as its own process on a free port, exactly as the fleet
manager launches it. Any test fixture can use :func:`start_sim`; it imports nothing from Django.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from engine_adapter.conf import REPO_ROOT
from engine_adapter.sim.config import sim_command

# Token rates at which a test's generations take milliseconds: start_sim(**FAST_RATES).
FAST_RATES: dict[str, object] = {
    "prefill_tokens_per_s": 10_000_000,
    "decode_tokens_per_s": 1_000_000,
}


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class SimProcess:
    """A running simulator subprocess."""

    base_url: str
    port: int
    model: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] | None = field(default=None, repr=False)

    def is_alive(self) -> bool:
        """Return True while the process runs."""
        return self.process.poll() is None

    def wait_exit(self, timeout_s: float = 5.0) -> int:
        """Wait for the process to exit on its own; return its exit code."""
        return self.process.wait(timeout=timeout_s)

    def log_text(self) -> str:
        """Return what the simulator wrote to stdout and stderr."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Terminate the simulator (kill it if it lingers) and close its log."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_sim(
    *,
    served_model_name: str = "sim-model",
    port: int | None = None,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 20.0,
    **flags: object,
) -> SimProcess:
    """Start ``python -m engine_adapter.sim`` and return once ``/health`` answers 200.

    ``flags`` are launch flags in Python spelling, e.g. ``max_running_requests=1,
    decode_tokens_per_s=1e6, error_rate=1.0``. Call ``stop()`` (or use ``with``) when done.
    """
    port = port or free_port(host)
    log_fd, log_name = tempfile.mkstemp(prefix=f"sim-{port}-", suffix=".log")
    log = os.fdopen(log_fd, "wb")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        sim_command(port=port, served_model_name=served_model_name, host=host, **flags),
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    sim = SimProcess(
        base_url=f"http://{host}:{port}",
        port=port,
        model=served_model_name,
        process=process,
        log_path=Path(log_name),
        _log=log,
    )
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sim.stop()
            raise RuntimeError(f"simulator exited at start:\n{sim.log_text()}")
        try:
            with urllib.request.urlopen(f"{sim.base_url}/health", timeout=1) as resp:  # noqa: S310
                if resp.status == 200:
                    return sim
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    sim.stop()
    raise RuntimeError(f"simulator did not become healthy:\n{sim.log_text()}")

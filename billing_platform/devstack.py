"""The README's two commands: ``./tollgate up`` (run the platform) and ``./tollgate test``.

Both start PostgreSQL and Redis first: the servers named by ``DATABASE_URL`` / ``REDIS_URL``
when set, otherwise private embedded servers under ``./.tollgate/`` that are reused across runs.
``up`` then migrates, seeds the demo org, and runs web (uvicorn), worker and beat with their logs
interleaved under coloured prefixes; Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from billing_platform import env as E
from billing_platform.celery import Queues
from billing_platform.embedded import EmbeddedPostgres, EmbeddedRedis

COLOURS = {"web": "36", "worker": "33", "batch": "34", "beat": "35", "fleet": "32", "tollgate": "1"}


def say(msg: str, name: str = "tollgate") -> None:
    colour = COLOURS.get(name, "0")
    prefix = f"\033[{colour}m{name:>8} |\033[0m " if sys.stdout.isatty() else f"{name:>8} | "
    print(prefix + msg, flush=True)


class Services:
    """PostgreSQL and Redis for this run: configured ones, or embedded ones we start and stop."""

    def __init__(self, *, redis_db: int = 0) -> None:
        self.started: list[EmbeddedPostgres | EmbeddedRedis] = []
        self.redis_db = redis_db

    def ensure(self) -> dict[str, str]:
        """Start whatever is not configured; return the environment the children need."""
        urls = {}
        if E.DATABASE_URL_SET:
            urls["DATABASE_URL"] = E.DATABASE_URL
            say("PostgreSQL: using DATABASE_URL")
        else:
            pg = EmbeddedPostgres(E.STATE_DIR / "pgdata", E.EMBEDDED_PG_PORT)
            if not pg.running():
                say(f"PostgreSQL: starting embedded server on 127.0.0.1:{pg.port} "
                    f"(data in {pg.data_dir.relative_to(E.BASE_DIR)}; first start ~10 s)")
                pg.start()
                self.started.append(pg)
            else:
                say(f"PostgreSQL: reusing the embedded server on 127.0.0.1:{pg.port}")
            urls["DATABASE_URL"] = pg.url
        if E.REDIS_URL_SET:
            urls["REDIS_URL"] = E.REDIS_URL
            say("Redis: using REDIS_URL")
        else:
            redis = EmbeddedRedis(E.STATE_DIR / "redis", E.EMBEDDED_REDIS_PORT)
            if not redis.running():
                say(f"Redis: starting embedded server on 127.0.0.1:{redis.port}")
                redis.start()
                self.started.append(redis)
            else:
                say(f"Redis: reusing the embedded server on 127.0.0.1:{redis.port}")
            urls["REDIS_URL"] = f"redis://127.0.0.1:{redis.port}/{self.redis_db}"
        return urls

    def stop(self) -> None:
        for server in reversed(self.started):
            say(f"stopping embedded {type(server).__name__.removeprefix('Embedded')}")
            server.stop()
        self.started.clear()


def _manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], check=True, env=env, cwd=E.BASE_DIR)


def _pump(name: str, stream) -> None:
    for raw in iter(stream.readline, b""):
        say(raw.decode(errors="replace").rstrip(), name)


def _stop_on_signals() -> None:
    """Turn SIGINT and SIGTERM into KeyboardInterrupt, even where the shell ignored SIGINT."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_up(args: argparse.Namespace) -> int:
    _stop_on_signals()
    services = Services()
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    fleet_started = False
    env = dict(os.environ)
    try:
        env = {**os.environ, **services.ensure(), "PYTHONUNBUFFERED": "1"}
        say("applying migrations")
        _manage("migrate", "--noinput", "-v", "0", env=env)
        _manage("seed_catalog", env=env)
        # the demo key is printed only to a terminal; the file is where a redirected run finds it
        _manage("seed_demo", "--key-file",
                str((E.STATE_DIR / "demo-key").relative_to(E.BASE_DIR)), env=env)
        say("starting the engine fleet" + (" (simulated pools only)" if args.sim_only else
            "; the first run builds real SGLang for the CPU (~3.5 GB, a few minutes)"))
        fleet_started = True
        _manage("fleet", "up", *(["--sim-only"] if args.sim_only else []), env=env)
        E.STATE_DIR.mkdir(exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(fresh_metrics_dir())
        celery = [sys.executable, "-m", "celery", "-A", "billing_platform"]
        commands = {
            # N processes on one socket (uvicorn's supervisor restarts one that dies); what
            # each caches stays correct across them: docs/deploy.md, "Many gateway processes"
            "web": [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application",
                    "--host", E.WEB_HOST, "--port", str(E.WEB_PORT), "--lifespan", "on",
                    "--workers", str(args.web_processes),
                    "--no-access-log" if args.quiet else "--access-log"],
            "worker": [*celery, "worker", "-Q",
                       ",".join(q for q in Queues if q != Queues.BATCH),
                       "--concurrency", "2", "-l", "INFO", "-n", "tollgate@%h"],
            # batch lines run only on CPU nothing else wants (see background_priority)
            "batch": [*celery, "worker", "-Q", Queues.BATCH.value, "--concurrency", "1",
                      "-l", "INFO", "-n", "tollgate-batch@%h"],
            "beat": [*celery, "beat", "-l", "INFO", "-s",
                     str(E.STATE_DIR / "celerybeat-schedule")],
            # the usage stream consumer: a long-lived loop, see metering/ingest.py for why
            "ingest": [sys.executable, "manage.py", "ingest_usage"],
        }
        for name, argv in commands.items():
            proc = subprocess.Popen(argv, env=env, cwd=E.BASE_DIR, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=background_priority if name == "batch" else None)
            children.append((name, proc))
            threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True).start()
        url = f"http://{E.WEB_HOST}:{E.WEB_PORT}"
        say(f"web: {args.web_processes} gateway process(es) on {url} (--web-processes N)")
        say(f"console   {url}/console/   (log in with the demo login above)")
        say(f"API docs  {url}/api/v1/docs/   metrics {url}/metrics   admin {url}/admin/")
        say("press Ctrl-C to stop everything")
        while all(proc.poll() is None for _, proc in children):
            time.sleep(0.5)
        dead = [name for name, proc in children if proc.poll() is not None]
        say(f"{', '.join(dead)} exited; stopping the rest (see its log above)")
        return 1
    except KeyboardInterrupt:
        say("stopping (Ctrl-C)")
        return 0
    except subprocess.CalledProcessError as exc:
        say(f"set-up step failed: {' '.join(map(str, exc.cmd[1:]))} (see the error above)")
        return 1
    finally:
        for _name, proc in children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in children:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop in 15 s; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
        if fleet_started:
            say("stopping the engine fleet")
            subprocess.run([sys.executable, "manage.py", "fleet", "down"], env=env,
                           cwd=E.BASE_DIR, check=False)
        services.stop()


def fresh_metrics_dir() -> Path:
    """Return the directory the processes of this run share their metrics in, emptied.

    Each process writes its counters to files there and the web process's /metrics sums them
    (billing_platform/metrics.py); a new run starts from zero, as a restarted process would.
    """
    path = Path(E.PROMETHEUS_MULTIPROC_DIR or E.STATE_DIR / "metrics")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    return path


def background_priority() -> None:
    """Make this process (a batch worker; run before exec) use only CPU nothing else wants.

    On Linux, SCHED_IDLE: any ordinary process that wakes takes the CPU from it at once,
    where a niced process may hold it for the rest of its time slice. On one host with the
    gateway and engines, batch lines then fill idle cycles without delaying interactive
    requests (bench/batch_interference.py). Elsewhere, the lowest nice level.

    With the kernel's session autogroups on (the default on desktop and many server kernels),
    CPU is shared fairly between sessions first, and the policy of a process only counts
    within its session's group: a SCHED_IDLE worker started in a session of its own still
    took its group's fair share, measured as much as 0.75 of two busy cores. So when this
    process leads a session of its own (``start_new_session=True``), that session's group is
    set to nice 19 as well; a process sharing its caller's session leaves the group alone.
    """
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
    autogroup = Path("/proc/self/autogroup")
    if os.getsid(0) == os.getpid() and autogroup.exists():
        with contextlib.suppress(OSError):
            autogroup.write_text("19")


def cmd_test(args: argparse.Namespace) -> int:
    _stop_on_signals()
    # Tests use Redis db 15 of the embedded server so they never touch a dev run's data.
    services = Services(redis_db=15)
    try:
        env = {**os.environ, **services.ensure()}
        argv = [sys.executable, "-m", "ruff", "check", "."]
        if not args.pytest_args:
            say("ruff check")
            if subprocess.run(argv, cwd=E.BASE_DIR, check=False).returncode:
                say("ruff found problems (fix them, or run `.venv/bin/ruff check --fix .`)")
                return 1
            say("mypy (the apps, as [tool.mypy] in pyproject.toml says)")
            if subprocess.run([sys.executable, "-m", "mypy"], cwd=E.BASE_DIR,
                              check=False).returncode:
                say("mypy found type errors (fix them; run it alone with `.venv/bin/mypy`)")
                return 1
        say("real SGLang for the CPU: building or checking .tollgate/sglang-venv "
            "(first run ~2-3 min, ~3.5 GB; then instant)")
        if subprocess.run([sys.executable, "-m", "engine_adapter.sglang_cpu", "setup"],
                          cwd=E.BASE_DIR, check=False).returncode:
            say("the SGLang CPU set-up failed (see above); the real-engine tests need it")
            return 1
        _ensure_chromium()
        say("running the test suite")
        return subprocess.run(
            [sys.executable, "-m", "pytest", *args.pytest_args], env=env, cwd=E.BASE_DIR,
            check=False,
        ).returncode
    finally:
        services.stop()


def _ensure_chromium() -> None:
    """Install Debian's Chromium for the console's browser test, where this machine can."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        say("Chromium not found and cannot be installed here: the browser test will be skipped")
        return
    say("installing Debian's chromium for the console browser test (once, ~1 min)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "install", "-y", "-qq", "chromium"],
                 ["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(argv, env=env, check=False, capture_output=True)
        if argv[1] == "install" and done.returncode == 0:
            return
    say("could not install chromium (apt-get failed): the browser test will be skipped")


def cmd_services(args: argparse.Namespace) -> int:
    services = Services()
    for key, value in services.ensure().items():
        print(f"export {key}={value}")
    return 0


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the platform (web, worker, beat) until Ctrl-C")
    up.add_argument("--quiet", action="store_true", help="no per-request access log")
    up.add_argument("--sim-only", action="store_true",
                    help="simulated engines only (starts in seconds; no real SGLang build)")
    up.add_argument("--web-processes", type=_positive, default=os.cpu_count() or 1,
                    metavar="N", help="web (gateway) processes on the one port (default: the "
                                      "machine's cores)")
    up.set_defaults(func=cmd_up)
    test = sub.add_parser("test",
                          help="run ruff, mypy and the test suite (extra args go to pytest)")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER)
    test.set_defaults(func=cmd_test)
    services = sub.add_parser("services", help="start PostgreSQL/Redis, print their URLs")
    services.set_defaults(func=cmd_services)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "test":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "test":  # pytest options like -x or -k go straight through
        args.pytest_args = [*extra, *args.pytest_args]
    os.chdir(Path(E.BASE_DIR))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

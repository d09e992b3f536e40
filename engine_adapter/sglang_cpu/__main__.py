"""Command line for the SGLang CPU environment: setup, status, serve, check, lock.

CI and developers build the environment with one idempotent command before the tests that
start real SGLang; ``serve`` and ``check`` start a server from the same launch spec the fleet
launcher uses, so what works by hand works there too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine_adapter.sglang_cpu.launch import get_json, launch_spec, wait_healthy
from engine_adapter.sglang_cpu.recipe import (
    SetupError,
    ensure_ready,
    lock,
    resolve_paths,
    setup,
    stale_steps,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(root: Path | None) -> int:
    paths = resolve_paths(root)
    stale = stale_steps(paths.root)
    report = {"root": str(paths.root), "ready": not stale, "stale_steps": stale}
    print(json.dumps(report, indent=2))  # noqa: T201
    return 0 if not stale else 1


def _serve(root: Path | None, port: int, name: str, extra: list[str]) -> int:
    paths = ensure_ready(root)
    argv, env = launch_spec(
        model_dir=paths.model_dir,
        port=port,
        served_model_name=name,
        extra_args=extra,
        root=paths.root,
    )
    os.execve(argv[0], argv, env)  # noqa: S606 - replaces this process with the server
    return 0  # pragma: no cover


def _check(root: Path | None) -> int:
    """Start one server, generate a few tokens, stop it: proof the environment works."""
    paths = ensure_ready(root)
    port = _free_port()
    argv, env = launch_spec(
        model_dir=paths.model_dir, port=port, served_model_name="tiny", root=paths.root
    )
    log_file = paths.logs / "check-server.log"
    started = time.monotonic()
    with log_file.open("w") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            waited = wait_healthy(base, timeout=180, is_alive=lambda: server.poll() is None)
            body = json.dumps({"text": "def main():", "sampling_params": {"max_new_tokens": 8}})
            request = urllib.request.Request(  # noqa: S310 - local server
                f"{base}/generate", data=body.encode(), headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
                result = json.loads(response.read())
            info = get_json(f"{base}/get_model_info")
        except Exception as exc:
            print(f"[sglang-cpu] check failed: {exc}; server log: {log_file}", file=sys.stderr)  # noqa: T201
            return 1
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    tokens = result["meta_info"]["completion_tokens"]
    print(  # noqa: T201
        f"[sglang-cpu] check ok: healthy after {waited:.1f}s, generated {tokens} tokens with "
        f"{info['architectures']} from {info['model_path']}, {time.monotonic() - started:.1f}s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m engine_adapter.sglang_cpu")
    parser.add_argument("--root", type=Path, default=None, help="default: .tollgate at repo root")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in {
        "setup": "build the venv, shim and model (idempotent, cached)",
        "status": "say whether setup is up to date (exit 1 if not)",
        "check": "start one server, generate, stop",
        "lock": "re-resolve requirements-cpu.in into requirements-cpu.txt",
    }.items():
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--root", type=Path, default=argparse.SUPPRESS)
    serve = commands.add_parser("serve", help="run one server in the foreground")
    serve.add_argument("--root", type=Path, default=argparse.SUPPRESS)
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--served-model-name", default="tiny")
    serve.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra sglang flags")
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            setup(args.root)
            return 0
        if args.command == "status":
            return _status(args.root)
        if args.command == "check":
            return _check(args.root)
        if args.command == "lock":
            lock(args.root)
            return 0
        extra = [a for a in args.extra if a != "--"]
        return _serve(args.root, args.port, args.served_model_name, extra)
    except SetupError as exc:
        print(f"[sglang-cpu] setup error: {exc}", file=sys.stderr)  # noqa: T201
        return 2


if __name__ == "__main__":
    sys.exit(main())

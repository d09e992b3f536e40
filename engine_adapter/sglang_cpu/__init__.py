"""Real SGLang on a CPU: the recipe that builds its environment, and how to launch it.

The platform's tests and demo prove the engine adapter against the real engine on machines
without a GPU. This package owns everything that takes: a pinned virtualenv, the CPU-test glue
in ``shim/``, a tiny locally made model, and the exact server command line. It imports only the
standard library and nothing from the rest of the platform.

    python -m engine_adapter.sglang_cpu setup [--root .tollgate]
"""

from engine_adapter.sglang_cpu.launch import CPU_SERVER_ARGS, get_json, launch_spec, wait_healthy
from engine_adapter.sglang_cpu.recipe import (
    SetupError,
    SglangPaths,
    default_root,
    ensure_ready,
    is_ready,
    resolve_paths,
    setup,
    stale_steps,
)

__all__ = [
    "CPU_SERVER_ARGS",
    "SetupError",
    "SglangPaths",
    "default_root",
    "ensure_ready",
    "get_json",
    "is_ready",
    "launch_spec",
    "resolve_paths",
    "setup",
    "stale_steps",
    "wait_healthy",
]

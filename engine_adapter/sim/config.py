"""Command line of the simulator, shaped like ``python -m sglang.launch_server``.

The fleet manager builds one launch line per engine; keeping the flag names SGLang uses (and
accepting the SGLang flags that change nothing here) lets a pool switch between ``sglang`` and
``sim`` by changing only the module name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from engine_adapter import conf


@dataclass
class Faults:
    """Fault injection settings; changeable at run time through ``POST /sim/faults``."""

    error_rate: float = 0.0
    stall_s: float = 0.0
    crash_after: int | None = None
    fail_after_tokens: int | None = None
    # A hung engine: the process accepts connections and answers /health, /metrics and info,
    # but its scheduler never steps again (no request starts or gets another token, and
    # /health_generate times out), as a wedged GPU or a deadlocked scheduler leaves SGLang.
    hang: bool = False


@dataclass
class SimConfig:
    """Everything the simulated engine needs to know at start."""

    served_model_name: str = "sim-model"
    model_path: str = "tollgate/sim-model"
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int = 64
    max_total_tokens: int = 200_000
    context_length: int = 32_768
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 100.0
    seed: int = 0
    low_priority_values_first: bool = False
    log_level: str = "warning"
    # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: how long /health_generate waits for the scheduler
    health_check_timeout_s: float = 20.0
    # A reasoning model behind SGLang's ``--reasoning-parser``: a chat completion's first
    # ``reasoning_tokens`` tokens are its thinking (0: the model does not reason).
    reasoning_tokens: int = 0
    # SGLang's ``--is-embedding``: the engine answers /v1/embeddings (vectors of
    # ``embedding_dim`` floats, the model's hidden size) and refuses generation.
    is_embedding: bool = False
    embedding_dim: int = 64
    # ``--json-model-override-args '{"is_matryoshka": true}'``: ``dimensions`` may shorten
    # an embedding (SGLang refuses it otherwise).
    is_matryoshka: bool = False
    faults: Faults | None = None

    def __post_init__(self) -> None:
        if self.faults is None:
            self.faults = Faults()


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser for ``python -m engine_adapter.sim``."""
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.sim",
        description="Simulated SGLang engine for tests and benchmarks (not a product engine).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--model-path", "--model", default="tollgate/sim-model")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=200_000)
    parser.add_argument("--context-length", type=int, default=32_768)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--decode-tokens-per-s", type=float, default=100.0)
    parser.add_argument("--seed", "--random-seed", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--fail-after-tokens", type=int, default=None)
    parser.add_argument("--hang", action="store_true", help="start hung (see Faults.hang)")
    parser.add_argument("--schedule-low-priority-values-first", action="store_true")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--sim-reasoning-tokens", type=int, default=0,
                        help="chat completions think this many tokens first (SGLang's "
                             "reasoning parser splits them off as reasoning_content)")
    parser.add_argument("--is-embedding", action="store_true",
                        help="serve /v1/embeddings instead of generation, as SGLang's flag")
    parser.add_argument("--sim-embedding-dim", type=int, default=64,
                        help="the length of an embedding (the model's hidden size)")
    # SGLang flags that the launch line carries and that change nothing in the simulator: the
    # cache report, metrics and priority scheduling are always on here; its constrained JSON
    # has no free whitespace and its forced tool calls are parsed whatever the parser.
    for flag in ("--enable-cache-report", "--enable-metrics", "--enable-priority-scheduling",
                 "--constrained-json-disable-any-whitespace"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--json-model-override-args", default="{}",
                        help="as SGLang's; the simulator reads is_matryoshka from it")
    for flag in ("--tp-size", "--tp", "--dp-size", "--mem-fraction-static", "--device",
                 "--reasoning-parser", "--tool-call-parser"):
        parser.add_argument(flag, default=None)
    return parser


def sim_command(
    *, port: int, served_model_name: str, host: str = "127.0.0.1", **flags: object
) -> list[str]:
    """Return the launch line; ``flags`` become ``--flag-name value`` (True: bare flag).

    The fleet manager launches simulated pools with it, and the tests' ``start_sim`` does too.
    """
    cmd = [
        sys.executable,
        "-m",
        "engine_adapter.sim",
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
    ]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        cmd.append("--" + name.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd


def parse_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse a launch line into a :class:`SimConfig`."""
    args = build_parser().parse_args(argv)
    if args.max_running_requests < 1:
        raise SystemExit("--max-running-requests must be at least 1")
    if args.prefill_tokens_per_s <= 0 or args.decode_tokens_per_s <= 0:
        raise SystemExit("token rates must be positive")
    try:
        overrides = json.loads(args.json_model_override_args)
    except ValueError:
        raise SystemExit("--json-model-override-args must be a JSON object") from None
    return SimConfig(
        served_model_name=args.served_model_name or args.model_path,
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        seed=args.seed,
        low_priority_values_first=args.schedule_low_priority_values_first,
        log_level=args.log_level,
        health_check_timeout_s=conf.sim_health_check_timeout_s(),
        reasoning_tokens=max(0, args.sim_reasoning_tokens),
        is_embedding=args.is_embedding,
        embedding_dim=max(1, args.sim_embedding_dim),
        is_matryoshka=bool(isinstance(overrides, dict) and overrides.get("is_matryoshka")),
        faults=Faults(
            error_rate=args.error_rate,
            stall_s=args.stall_s,
            crash_after=args.crash_after,
            fail_after_tokens=args.fail_after_tokens,
            hang=args.hang,
        ),
    )

"""Entry point: ``python -m engine_adapter.sim`` with SGLang-shaped launch flags.

Kept separate from the app so the fleet manager and tests can launch the simulator exactly like
``python -m sglang.launch_server``, as its own process with its own port.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvicorn

from engine_adapter.sim.app import create_app
from engine_adapter.sim.config import parse_args


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the launch line and serve until stopped."""
    config = parse_args(argv)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=1,
    )


if __name__ == "__main__":
    main(sys.argv[1:])

"""Seed a PostgreSQL of a test's own for a live gateway: prices, an organization, two keys and
one simulated engine of ``small``.

Run as ``python tests/gateway/outage_seed.py ENGINE_URL`` with DATABASE_URL pointing at the
(migrated) database. Prints ``{"keys": [secret, secret]}``: the test uses the first for its
traffic and keeps the second unused, so its first request needs a PostgreSQL lookup.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")


def main() -> None:
    import django

    django.setup()
    from tests.factories import ProjectFactory, make_key, make_price_book
    from tests.gateway.conftest import register_engine

    make_price_book(prices=[{"model": "small", "input": "0.50", "output": "1.50"}])
    project = ProjectFactory()
    secrets = [make_key(project, scopes=["inference", "batch"])[1] for _ in range(2)]
    # the simulator runs in the test's process tree: register_engine reads these two fields
    engine = SimpleNamespace(model="small", base_url=sys.argv[1])
    register_engine(engine, pool="small-us", region="us-east", zone="us")
    print(json.dumps({"keys": secrets}), flush=True)  # noqa: T201 - the test reads stdout


if __name__ == "__main__":
    main()

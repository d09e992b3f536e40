"""A stand-in gateway process for the failover tests: appends usage events until told to stop.

Run as ``python tests/metering/appender.py STOP_FILE`` with DATABASE_URL and the metering
``TOLLGATE_*`` variables set. It creates a priced organization, prints its id, then appends one
event every few milliseconds through ``metering.services.usage_event_append`` and prints
``<request id> <path>`` for each, until STOP_FILE exists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")


def main() -> None:
    import django

    django.setup()
    from metering.services import usage_event_append
    from tests.factories import ProjectFactory, make_key, make_price_book

    make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])
    project = ProjectFactory()
    key, _secret = make_key(project)
    org = project.organization
    print(json.dumps({"org_id": org.id}), flush=True)  # noqa: T201 - the test reads stdout
    stop_file = Path(sys.argv[1])
    i = 0
    while not stop_file.exists():
        request_id = f"req-{i}"
        path = usage_event_append({
            "request_id": request_id, "org_id": org.id, "project_id": project.id,
            "api_key_id": key.id, "model": "test-model", "region": "us-east",
            "data_zone": org.data_zone, "prompt_tokens": 100 + i, "completion_tokens": 10,
            "event_time": datetime.now(UTC),
        })
        print(f"{request_id} {path}", flush=True)  # noqa: T201
        i += 1
        time.sleep(0.003)


if __name__ == "__main__":
    main()

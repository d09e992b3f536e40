"""``/metrics``: what the platform exports to Prometheus, and who may read it.

Each app declares its own metrics in its ``metrics.py`` (``metering``, ``plans``,
``engine_adapter``, ``billing_platform.gateway``, ``billing_platform.invoicing``); this module
is the one place that puts them together and guards the endpoint. Two kinds:

* counters and histograms that code increments where things happen (a request answered, an
  event rated, a Stripe call failed). They live in whichever process did the work: the web
  process (``/v1`` and the rest), the usage consumer (``manage.py ingest_usage``) and the
  Celery workers (prefork children). With ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus_client
  keeps each process's values in memory-mapped files in that directory and ``/metrics`` sums
  them, so one scrape of the web process sees the work of every process on the host. That is
  prometheus_client's own answer for pre-forking servers (gunicorn, Celery's prefork pool),
  where per-process endpoints cannot work: a pool child has no port of its own and dies and is
  replaced at will, and a scraper would have to discover each one. ``./tollgate up`` sets the
  directory and empties it at start (a file per process, kept after the process exits so its
  counts stay in the totals). Unset, ``/metrics`` shows the web process's own values only.
* gauges read at scrape time from PostgreSQL, Redis or the disk (ingest backlog and lag, dead
  letters, spool size, batch backlog, engine health and load, the billing invariant's last
  check): ``SCRAPE_COLLECTORS``. Each is a handful of bounded queries under a statement
  timeout; one that fails is logged and reported as ``tollgate_scrape_collector_up 0``, and the
  rest of the page is still served.

Access (``TOLLGATE_METRICS_ALLOWED_NETWORKS``, ``TOLLGATE_METRICS_TOKEN``): the client address
must be in the allow-list (403 otherwise; loopback only by default), and when a token is set
the request must also carry it as ``Authorization: Bearer <token>`` (401 otherwise). The
address is the one uvicorn reports, which honours ``X-Forwarded-For`` only from the proxies
in its ``--forwarded-allow-ips`` (loopback by default).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

from celery import signals
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from billing_platform import env

log = logging.getLogger(__name__)

# Read at scrape time by the web process; each is a class with ``collect()`` (no arguments).
SCRAPE_COLLECTORS = (
    "metering.metrics.MeteringCollector",
    "billing_platform.gateway.metrics.BatchCollector",
    "engine_adapter.metrics.EngineCollector",
    "billing_platform.invoicing.invariants.BillingInvariantCollector",
)

CELERY_TASKS = Counter(
    "tollgate_celery_tasks_total", "Celery tasks finished, by task name and final state "
    "(success, failure, retry, ...).", ["task", "state"])
CELERY_TASK_SECONDS = Histogram(
    "tollgate_celery_task_seconds", "Run time of Celery tasks.", ["task"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 3600))


# --- Celery: every task's outcome and duration, whichever app it belongs to -----------------

_task_started: dict[str, float] = {}
TASK_STATES = ("success", "failure", "retry")


@signals.worker_init.connect
@signals.worker_process_init.connect
def _tasks_known(**_: Any) -> None:
    """Start each task's outcome series at 0 in this worker (a pool child, or a solo worker),
    so an alert on ``increase()`` sees a task's first failure too."""
    from celery import current_app

    for name in list(current_app.tasks):
        if not name.startswith("celery."):
            for state in TASK_STATES:
                CELERY_TASKS.labels(name, state)


@signals.task_prerun.connect
def _task_prerun(task_id: str | None = None, **_: Any) -> None:
    if task_id:
        _task_started[task_id] = time.perf_counter()


@signals.task_postrun.connect
def _task_postrun(task_id: str | None = None, task: Any = None, state: str | None = None,
                  **_: Any) -> None:
    name = getattr(task, "name", None) or "unknown"
    CELERY_TASKS.labels(name, (state or "unknown").lower()).inc()
    started = _task_started.pop(task_id or "", None)
    if started is not None:
        CELERY_TASK_SECONDS.labels(name).observe(time.perf_counter() - started)


# --- scrape-time collectors -------------------------------------------------------------------

class _ScrapeTime:
    """Run each of ``SCRAPE_COLLECTORS``; a failing one is logged and reported, not fatal."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tollgate_scrape_collector_up",
                               "1 if the scrape-time collector answered at the last scrape.",
                               labels=["collector"])
        for path in SCRAPE_COLLECTORS:
            name = path.rsplit(".", 1)[1]
            try:
                families = list(_collector(path).collect())
            except Exception:
                log.warning("metrics collector %s failed", name, exc_info=True)
                up.add_metric([name], 0)
                continue
            up.add_metric([name], 1)
            yield from families
        yield up


@cache
def _collector(path: str) -> Any:
    return import_string(path)()


class _Everything:
    """What one scrape returns: pushed metrics (all processes' or this one's), then gauges."""

    def collect(self) -> Iterator[Metric]:
        if multiprocess_dir():
            yield from MultiProcessCollector(None).collect()
        else:
            yield from REGISTRY.collect()
        yield from _ScrapeTime().collect()


def multiprocess_dir() -> str:
    """Return the directory shared by this host's processes, or "" (single-process mode)."""
    return env.PROMETHEUS_MULTIPROC_DIR


# --- the endpoint -----------------------------------------------------------------------------

@cache
def _networks(allowed: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network,
                                                 ...]:
    return tuple(ipaddress.ip_network(n, strict=False) for n in allowed)


def client_allowed(address: str, allowed: Iterable[str]) -> bool:
    """Return whether ``address`` (REMOTE_ADDR) lies in one of the ``allowed`` networks."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d
    return any(ip in net for net in _networks(tuple(allowed)) if net.version == ip.version)


def _refusal(request: HttpRequest) -> HttpResponse | None:
    if not client_allowed(request.META.get("REMOTE_ADDR", ""),
                          settings.METRICS_ALLOWED_NETWORKS):
        return HttpResponse("Forbidden: this address may not read /metrics (see "
                            "TOLLGATE_METRICS_ALLOWED_NETWORKS).\n", status=403,
                            content_type="text/plain")
    token = settings.METRICS_TOKEN
    if token:
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            response = HttpResponse("Unauthorized: send Authorization: Bearer <the metrics "
                                    "token> (TOLLGATE_METRICS_TOKEN).\n", status=401,
                                    content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    return None


@csrf_exempt  # a read; any other method is a 405 below, after the access check
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve every metric of this host's processes in Prometheus' text format."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(_Everything()), content_type=content_type)

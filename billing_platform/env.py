"""The one place that reads the environment.

Unset infrastructure settings mean the embedded default (the devstack starts private PostgreSQL
and Redis servers under ``./.tollgate/`` and exports their URLs before Django starts), never a
crash. Secrets must be set explicitly when ``TOLLGATE_ENV=production``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = BASE_DIR / ".tollgate"

env = environ.Env()

TOLLGATE_ENV: str = env.str("TOLLGATE_ENV", default="development")
PRODUCTION: bool = TOLLGATE_ENV == "production"

# Ports of the embedded servers; only used when DATABASE_URL / REDIS_URL are unset.
EMBEDDED_PG_PORT: int = env.int("TOLLGATE_PG_PORT", default=54329)
EMBEDDED_REDIS_PORT: int = env.int("TOLLGATE_REDIS_PORT", default=63799)

DATABASE_URL: str = env.str(
    "DATABASE_URL", default=f"postgres://postgres@127.0.0.1:{EMBEDDED_PG_PORT}/tollgate"
)
# An optional streaming replica of DATABASE_URL for the read-heavy report pages
# (billing_platform/db.py says which); unset, everything reads DATABASE_URL. Past the lag bound
# (seconds), or when it does not answer, those pages read the primary.
DATABASE_REPLICA_URL: str = env.str("DATABASE_REPLICA_URL", default="")
DATABASE_REPLICA_MAX_LAG_S: float = env.float("DATABASE_REPLICA_MAX_LAG_S", default=5.0)
REDIS_URL: str = env.str("REDIS_URL", default=f"redis://127.0.0.1:{EMBEDDED_REDIS_PORT}/0")
# Whether the environment names the servers itself: the devstack starts an embedded server only
# for the one it does not.
DATABASE_URL_SET: bool = bool(env.str("DATABASE_URL", default=""))
REDIS_URL_SET: bool = bool(env.str("REDIS_URL", default=""))
# A Redis Cluster for the platform's own keys (quota state, API-key cache, usage stream): the
# URL of any one node, e.g. redis://10.0.0.5:7000/0 (the clients discover the rest). Unset: those
# keys live on REDIS_URL. The Celery broker and Django's cache stay on REDIS_URL either way
# (kombu's Redis transport does not support Cluster).
REDIS_CLUSTER_URL: str = env.str("REDIS_CLUSTER_URL", default="")
# The Celery broker: REDIS_URL's Redis unless named apart (amqp://... for RabbitMQ).
CELERY_BROKER_URL: str = env.str("CELERY_BROKER_URL", default=REDIS_URL)


def _secret(name: str, *, dev_default: str) -> str:
    """Return a secret; in production it must be set and not blank (refuse to start)."""
    value = env.str(name, default="")
    if PRODUCTION and not value.strip():
        raise ImproperlyConfigured(
            f"TOLLGATE_ENV=production requires {name} to be set (it is unset or empty); "
            f"refusing to start.")
    return value or dev_default


_DEV_SECRET = "dev-insecure-secret-key-change-me-in-production-0123456789"  # noqa: S105
SECRET_KEY: str = _secret("SECRET_KEY", dev_default=_DEV_SECRET)
DEBUG: bool = env.bool("DEBUG", default=not PRODUCTION)


def _allowed_hosts() -> list[str]:
    """Return the host names served; production must name them (refuse to start otherwise)."""
    hosts = [h.strip() for h in env.list("ALLOWED_HOSTS", default=[]) if h.strip()]
    if PRODUCTION and not hosts:
        raise ImproperlyConfigured(
            "TOLLGATE_ENV=production requires ALLOWED_HOSTS to be set to the host names this "
            "platform is served under, comma-separated (e.g. "
            "ALLOWED_HOSTS=billing.example.com,api.example.com); it is unset or empty; "
            "refusing to start.")
    return hosts or ["*"]


def _proxy_ssl_header(raw: str) -> tuple[str, str] | None:
    """Parse ``"X-Forwarded-Proto: https"`` into ``("HTTP_X_FORWARDED_PROTO", "https")``."""
    if not raw.strip():
        return None
    name, sep, value = raw.partition(":")
    if not sep or not name.strip() or not value.strip():
        raise ImproperlyConfigured(
            f"TOLLGATE_SECURE_PROXY_SSL_HEADER must look like 'X-Forwarded-Proto: https' (the "
            f"header your TLS-terminating proxy sets, and its value on HTTPS); got {raw!r}.")
    return "HTTP_" + name.strip().upper().replace("-", "_"), value.strip()


ALLOWED_HOSTS: list[str] = _allowed_hosts()
# HTTPS in production (see the security section of settings.py). HSTS is sent only on requests
# Django sees as HTTPS: behind a proxy that terminates TLS, name the header the proxy sets (only
# if the proxy always sets or strips it, or clients could claim HTTPS).
HSTS_SECONDS: int = env.int("TOLLGATE_HSTS_SECONDS", default=365 * 24 * 3600 if PRODUCTION else 0)
HSTS_INCLUDE_SUBDOMAINS: bool = env.bool("TOLLGATE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_PROXY_SSL_HEADER: tuple[str, str] | None = _proxy_ssl_header(
    env.str("TOLLGATE_SECURE_PROXY_SSL_HEADER", default=""))
# Console and admin login throttle (django-axes): this many failed logins per (username, client
# address) lock that pair out for the cool-off period.
LOGIN_FAILURE_LIMIT: int = env.int("TOLLGATE_LOGIN_FAILURE_LIMIT", default=5)
LOGIN_COOLOFF_MINUTES: int = env.int("TOLLGATE_LOGIN_COOLOFF_MINUTES", default=15)
# /v1 throttle of failed API-key authentications (billing_platform/accounts/auth_throttle.py):
# this many failures from one client address (an IPv6 /64) within the window, and its requests
# are answered 429 until the window ends, without a key lookup in PostgreSQL.
AUTH_FAILURE_LIMIT: int = env.int("TOLLGATE_AUTH_FAILURE_LIMIT", default=20)
AUTH_FAILURE_WINDOW_S: int = env.int("TOLLGATE_AUTH_FAILURE_WINDOW_S", default=60)

STRIPE_API_KEY: str = env.str("STRIPE_API_KEY", default="")
# The publishable key (pk_...) Stripe.js needs for the console's card form (Stripe Elements);
# unset, the billing page loads nothing from js.stripe.com and says how to add a card in test mode.
STRIPE_PUBLISHABLE_KEY: str = env.str("STRIPE_PUBLISHABLE_KEY", default="")
# Unset outside production: the webhook endpoint accepts nothing (and says what to set), since a
# signature checked against an empty secret proves nothing.
STRIPE_WEBHOOK_SECRET: str = _secret("STRIPE_WEBHOOK_SECRET", dev_default="")

EMAIL_URL: str = env.str("EMAIL_URL", default="consolemail://")
DEFAULT_FROM_EMAIL: str = env.str("DEFAULT_FROM_EMAIL", default="Tollgate <billing@tollgate.local>")
PUBLIC_URL: str = env.str("TOLLGATE_PUBLIC_URL", default="http://127.0.0.1:8000")

# /metrics (billing_platform/metrics.py): the client address must be in one of these networks
# (403 otherwise), and when a token is set the request must also carry it as a bearer token
# (401 otherwise). Default: loopback only, no token.
METRICS_ALLOWED_NETWORKS: list[str] = env.list("TOLLGATE_METRICS_ALLOWED_NETWORKS",
                                               default=["127.0.0.0/8", "::1/128"])
try:
    METRICS_ALLOWED_NETWORKS = [str(ipaddress.ip_network(n.strip(), strict=False))
                                for n in METRICS_ALLOWED_NETWORKS if n.strip()]
except ValueError as exc:
    raise ImproperlyConfigured(f"TOLLGATE_METRICS_ALLOWED_NETWORKS: {exc}") from None
METRICS_TOKEN: str = env.str("TOLLGATE_METRICS_TOKEN", default="").strip()
# prometheus_client's multi-process mode: every process of a host keeps its metrics in files
# here and /metrics sums them (`./tollgate up` sets it to .tollgate/metrics, emptied at start).
PROMETHEUS_MULTIPROC_DIR: str = env.str("PROMETHEUS_MULTIPROC_DIR", default="")

WEB_HOST: str = env.str("TOLLGATE_HOST", default="127.0.0.1")
WEB_PORT: int = env.int("TOLLGATE_PORT", default=8000)

# Invoicing: Stripe's API base (a localstripe URL in tests and dev) and the dunning schedule
# (days after each failed charge).
STRIPE_API_BASE: str = env.str("STRIPE_API_BASE", default="https://api.stripe.com")
INVOICING_DUNNING_DAYS: list[int] = [
    int(d) for d in env.list("TOLLGATE_DUNNING_DAYS", default=["1", "3", "7"])]
# The seller printed on every invoice: the operator's legal name, postal address (lines
# separated by ";"), tax id (VAT number) and the email customers write to about invoices.
SELLER_NAME: str = env.str("TOLLGATE_SELLER_NAME", default="Tollgate")
SELLER_ADDRESS: list[str] = [
    line.strip() for line in env.str("TOLLGATE_SELLER_ADDRESS", default="").split(";")
    if line.strip()]
SELLER_TAX_ID: str = env.str("TOLLGATE_SELLER_TAX_ID", default="")
SELLER_EMAIL: str = env.str("TOLLGATE_SELLER_EMAIL", default="")

# Batch API: where uploaded and generated files live (object storage later).
FILES_DIR: str = env.str("TOLLGATE_FILES_DIR", default=str(STATE_DIR / "files"))
# What one organization may hold there (an organization's own max_stored_* fields, set by
# staff, take precedence), and the free space an upload must leave on the disk of FILES_DIR,
# so a filling disk refuses new files before PostgreSQL and the usage spool run out of room.
ORG_MAX_STORED_FILES: int = env.int("TOLLGATE_ORG_MAX_STORED_FILES", default=1000)
ORG_MAX_STORED_BYTES: int = env.int("TOLLGATE_ORG_MAX_STORED_BYTES", default=10 * 1024**3)
FILES_DISK_RESERVE_BYTES: int = env.int("TOLLGATE_FILES_DISK_RESERVE_BYTES", default=1024**3)
# Requests one organization may have in flight on /v1 at once (its max_concurrent_requests
# field takes precedence); a slot a crashed process never released lapses after the lease.
ORG_MAX_CONCURRENT_REQUESTS: int = env.int("TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS", default=256)
ORG_CONCURRENCY_LEASE_S: float = env.float("TOLLGATE_ORG_CONCURRENCY_LEASE_S", default=900.0)
# A busy organization's slots a web process takes ahead and hands out itself
# (plans/concurrency.py): a pool starts at 1/16 of the limit and grows while all of it is in
# use, to at most 1/4 of the limit and at most this many; 0: none.
ORG_CONCURRENCY_POOL_MAX: int = env.int("TOLLGATE_ORG_CONCURRENCY_POOL_MAX", default=64)
# A web process keeps the API-key entries it read from Redis while Redis tells it of every
# change (client-side caching, accounts/keycache.py): a busy key costs no Redis read. 0: off.
API_KEY_NEAR_CACHE: bool = env.bool("TOLLGATE_API_KEY_NEAR_CACHE", default=True)
# Batch execution: seconds a claimed chunk of lines stays leased to one worker; after that a
# dead worker's lines are claimed again.
BATCH_LEASE_S: float = env.float("TOLLGATE_BATCH_LEASE_S", default=120.0)
# Batch lines fill the engines' slots as interactive latency allows (gateway/batch/guard.py).
# The floor: the share of each engine's slots batch may fill (interactive requests count
# against it) while interactive traffic runs and its TTFT has not shown that more costs
# nothing. 1/16: on the 2-core bench, where engines, gateway and batch worker share the CPU,
# a fixed 1/8 cost interactive TTFT p99 about 10 % (16,000 requests: ratio 1.10, 90 % interval
# 1.06-1.16) and 1/16 nothing measurable (0.98, 0.95-1.02) (bench/batch_interference.py).
# 1.0: no guard at all (every slot, whatever interactive traffic gets).
BATCH_MAX_RUNNING_FRACTION: float = env.float("TOLLGATE_BATCH_MAX_RUNNING_FRACTION",
                                              default=0.0625)
# Slots of each engine batch leaves free on an idle fleet (no interactive request for
# BATCH_IDLE_S), for the first interactive arrivals; either way the guard falls to the floor at
# the next probe once they are there (and they queue ahead of batch: lowest priority). 1: on
# the 2-core bench (bench/batch_interference.py, 16,000 requests, calm machine) none free gave
# an idle fill of 1.03 but interactive TTFT p99 1.78x (90 % interval 1.66-1.91: arrivals wait
# for a running line to end, engines do not preempt); one free of 16 gave p99 0.69x, p50 1.03x.
# On an idle fleet one free slot of 16 costs at most its share of the slots: where the engines
# bound the rate (2 x 16 slots at 100 tokens/s) 0.90 of the unguarded lines/s, where the host's
# CPU does about nothing (8 and 10 alternating rounds: 0.99, 1.15). Slices on the shared 2-core
# host vary 2x and more: one earlier run read 0.72 (three 5 s slices of each kind), a run at
# load average 12-14 0.77 with a 90 % interval of 0.55-1.00 (six 3 s slices), and twelve 3 s
# slices of each kind right after it 1.03 (0.96-1.12). Interactive latency is what the guard is
# for: 1.
BATCH_FREE_SLOTS: int = env.int("TOLLGATE_BATCH_FREE_SLOTS", default=1)
BATCH_IDLE_S: float = env.float("TOLLGATE_BATCH_IDLE_S", default=2.0)
# Above the floor, the share grows by this much of each engine's slots at a time, each step
# judged on the TTFT of the interactive requests after it (at least BATCH_TTFT_WINDOW_S of
# them and BATCH_TTFT_MIN_SAMPLES requests), and only while their mean TTFT and their typical
# (geometric mean) TTFT both stay within BATCH_TTFT_TOLERANCE of the baseline (those at the
# floor); the last window above it, or any engine queueing, takes the share back to the floor
# at once.
BATCH_GROW_FRACTION: float = env.float("TOLLGATE_BATCH_GROW_FRACTION", default=0.0625)
BATCH_TTFT_TOLERANCE: float = env.float("TOLLGATE_BATCH_TTFT_TOLERANCE", default=0.05)
BATCH_TTFT_WINDOW_S: float = env.float("TOLLGATE_BATCH_TTFT_WINDOW_S", default=0.6)
BATCH_TTFT_MIN_SAMPLES: int = env.int("TOLLGATE_BATCH_TTFT_MIN_SAMPLES", default=20)
# How often a gateway process adds the interactive TTFTs it measured to Redis, for that guard
# (gateway/ttft_signal.py): one pipelined write per interval while it has traffic.
TTFT_SIGNAL_FLUSH_S: float = env.float("TOLLGATE_TTFT_SIGNAL_FLUSH_S", default=0.2)
# While interactive requests run, batch lines start only while the batch worker's host was
# less busy than this share of its CPUs (the worker's own use not counted) over the last probe:
# where gateway, engines and batch worker share a machine, the CPU is part of the spare
# capacity batch may use, and a busy host is interference before the TTFT window shows it. On
# an idle fleet it does not apply (nothing to protect). 1.0 turns the check off (a worker on a
# host of its own never comes near it).
BATCH_HOST_CPU_CEILING: float = env.float("TOLLGATE_BATCH_HOST_CPU_CEILING", default=0.75)
# Where that check reads the host's CPU counters (the kernel's format; a test points it at a
# file it writes, so what it asserts does not depend on what else the machine runs).
BATCH_HOST_STAT: str = env.str("TOLLGATE_BATCH_HOST_STAT", default="/proc/stat")
# Beat periods (seconds) of the periodic tasks whose period a deployment or a test may change;
# the schedule itself is in billing_platform/celery.py. The batch sweep expires, cancels and
# restarts orphaned batches.
BATCH_SWEEP_S: float = env.float("TOLLGATE_BATCH_SWEEP_S", default=15.0)
LAST_USED_FLUSH_S: float = env.float("TOLLGATE_LAST_USED_FLUSH_S", default=30.0)
BUDGET_SWEEP_S: float = env.float("TOLLGATE_BUDGET_SWEEP_S", default=60.0)
FLEET_HEALTH_S: float = env.float("TOLLGATE_FLEET_HEALTH_S", default=5.0)
PERIOD_CLOSE_S: float = env.float("TOLLGATE_PERIOD_CLOSE_S", default=900.0)

# Gateway and quotas (see billing_platform/settings.py for what each means).
GATEWAY_DEFAULT_MAX_TOKENS: int = env.int("TOLLGATE_DEFAULT_MAX_TOKENS", default=4096)
GATEWAY_SATURATION_QUEUE_FACTOR: float = env.float("TOLLGATE_SATURATION_QUEUE_FACTOR",
                                                   default=4.0)
# Reserved capacity (gateway/capacity.py): one running request's decode rate assumed for an
# engine that has not measured its own yet (tokens/s; low, so a pool holds back too much
# rather than too little), and how long a process keeps the reservations in force.
PROVISIONED_SLOT_DECODE_TOKENS_PER_S: float = env.float(
    "TOLLGATE_PROVISIONED_SLOT_DECODE_TOKENS_PER_S", default=20.0)
PROVISIONED_SHARES_TTL_S: float = env.float("TOLLGATE_PROVISIONED_SHARES_TTL_S", default=5.0)
# Off: reservations keep only their engine priority, on-demand traffic may fill every slot
# (for engines that preempt running requests for queued ones of a higher priority, and for
# bench/provisioned.py's control run, which measures what the hold-back buys).
PROVISIONED_HOLD_BACK: bool = env.bool("TOLLGATE_PROVISIONED_HOLD_BACK", default=True)
# Days a stored Responses API answer is kept (gateway/response_store.py), and how often the
# beat deletes the expired ones.
RESPONSES_RETENTION_DAYS: int = env.int("TOLLGATE_RESPONSES_RETENTION_DAYS", default=30)
RESPONSES_EXPIRE_S: float = env.float("TOLLGATE_RESPONSES_EXPIRE_S", default=3600.0)
# /v1 slow clients (gateway/bodies.py, gateway/asgi.py): a request body that sends nothing for
# this long between two reads is answered 408, and a response that a client does not read for
# this long (one send blocked) is cut: its engine request aborted, metered client_aborted.
GATEWAY_BODY_READ_TIMEOUT_S: float = env.float("TOLLGATE_BODY_READ_TIMEOUT_S", default=30.0)
GATEWAY_SEND_TIMEOUT_S: float = env.float("TOLLGATE_SEND_TIMEOUT_S", default=30.0)
# How long a PostgreSQL connection of the gateway's database threads is kept open between
# their jobs (policy reloads, the fleet view, key lookups that miss the cache); 0 opens one
# per job. Django's CONN_MAX_AGE, for those threads only (gateway/db_connections.py).
GATEWAY_DB_CONN_MAX_AGE_S: float = env.float("TOLLGATE_GATEWAY_DB_CONN_MAX_AGE_S", default=60.0)
QUOTA_RESERVATION_TTL_S: float = env.float("TOLLGATE_RESERVATION_TTL_S", default=600.0)
QUOTA_POLICY_TTL_S: float = env.float("TOLLGATE_QUOTA_POLICY_TTL_S", default=2.0)
# How old a cached quota policy may still be served while its reloads fail (PostgreSQL
# down): past it a request gets the reload's error (503). The fleet view's bound is
# TOLLGATE_FLEET_MAX_STALE_S (engine_adapter/conf.py).
QUOTA_POLICY_MAX_STALE_S: float = env.float("TOLLGATE_QUOTA_POLICY_MAX_STALE_S",
                                            default=300.0)
# The most requests one quota lease may take (plans/admission/lease.py): a busy key's
# admissions are decided in the gateway process from a share of its limits; 0 turns leases
# off (every admission a Redis script step).
QUOTA_LEASE_MAX: int = env.int("TOLLGATE_QUOTA_LEASE_MAX", default=256)

# Budget-alert webhooks (plans/webhooks.py). Customers' URLs may not reach private, loopback,
# link-local (cloud metadata) or other non-public addresses unless this allows them (a
# deployment whose customers are on its own network; the tests' local receivers).
WEBHOOK_ALLOW_PRIVATE_ADDRESSES: bool = env.bool("TOLLGATE_WEBHOOK_ALLOW_PRIVATE_ADDRESSES",
                                                 default=False)
# A failed delivery is retried this many times, after about BACKOFF_S x 2^n seconds (jittered,
# at most an hour apart): the defaults keep trying for up to six hours.
BUDGET_WEBHOOK_MAX_RETRIES: int = env.int("TOLLGATE_BUDGET_WEBHOOK_MAX_RETRIES", default=12)
BUDGET_WEBHOOK_BACKOFF_S: int = env.int("TOLLGATE_BUDGET_WEBHOOK_BACKOFF_S", default=30)

# Fault injection for the ingest fault tests (metering/faults.py): ``<point>:<n>`` stalls the
# n-th pass through a named point of the ingest path; empty, nothing stalls.
INGEST_STALL_AT: str = env.str("TOLLGATE_INGEST_STALL_AT", default="")

# Warehouse export (billing_platform/finance/exports.py): where each UTC day's CSV.gz files and
# manifest go, how often beat looks for days to export (daily; each run exports every ended day
# not exported yet, so a missed beat is caught up), how long after a day ends it waits for late
# usage to land, and how many days back a run looks.
FINANCE_EXPORT_DIR: str = env.str("TOLLGATE_FINANCE_EXPORT_DIR",
                                  default=str(STATE_DIR / "exports"))
FINANCE_EXPORT_S: float = env.float("TOLLGATE_FINANCE_EXPORT_S", default=86400.0)
FINANCE_EXPORT_LAG_S: float = env.float("TOLLGATE_FINANCE_EXPORT_LAG_S", default=3600.0)
FINANCE_EXPORT_BACKFILL_DAYS: int = env.int("TOLLGATE_FINANCE_EXPORT_BACKFILL_DAYS", default=7)

# Console reservations page (billing_platform/console/reservation_views.py): whether an
# organization's owners and admins buy and renew provisioned throughput themselves (billed on
# the next invoice) or send a request that staff act on (the default).
RESERVATIONS_SELF_SERVE: bool = env.bool("TOLLGATE_RESERVATIONS_SELF_SERVE", default=False)

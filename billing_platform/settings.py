"""Django settings. Every value that varies per deployment comes from ``billing_platform.env``."""

from __future__ import annotations

from datetime import timedelta

import environ
from csp.constants import NONCE, NONE, SELF

from billing_platform import env as E

BASE_DIR = E.BASE_DIR
SECRET_KEY = E.SECRET_KEY
DEBUG = E.DEBUG
ALLOWED_HOSTS = E.ALLOWED_HOSTS
CSRF_TRUSTED_ORIGINS = [E.PUBLIC_URL]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "django_prometheus",
    "rest_framework",
    "drf_spectacular",
    "axes",
    "csp",
    "django_htmx",
    "billing_platform.accounts",
    "billing_platform.audit",
    "billing_platform.idempotency",
    "billing_platform.gateway",
    "billing_platform.invoicing",
    "billing_platform.console",
    "billing_platform.finance",
    "metering",
    "plans",
    "engine_adapter",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "csp.middleware.CSPMiddleware",
    "billing_platform.audit.context.RequestIdMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "billing_platform.db.ReadYourWritesMiddleware",  # after auth: it pins the signed-in user
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # turns a locked-out login into the lockout page
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "billing_platform.urls"
ASGI_APPLICATION = "billing_platform.asgi.application"
WSGI_APPLICATION = "billing_platform.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "billing_platform.console.context.current_org",
            ],
        },
    },
]

_db = environ.Env.db_url_config(E.DATABASE_URL)
if "postgres" not in _db["ENGINE"]:
    raise RuntimeError("Tollgate needs PostgreSQL: set DATABASE_URL=postgres://... or unset it")
_db["ENGINE"] = "django_prometheus.db.backends.postgresql"
_db["CONN_HEALTH_CHECKS"] = True
DATABASES = {"default": _db}
if E.DATABASE_REPLICA_URL:
    # The reporting replica (billing_platform/db.py): configured like the default, never
    # migrated or written (ReplicaRouter), a test run mirrors it onto the test database.
    _replica = environ.Env.db_url_config(E.DATABASE_REPLICA_URL)
    if "postgres" not in _replica["ENGINE"]:
        raise RuntimeError("DATABASE_REPLICA_URL must be a PostgreSQL URL (postgres://...)")
    _replica["ENGINE"] = _db["ENGINE"]
    _replica["CONN_HEALTH_CHECKS"] = True
    # a replica that does not answer must not hold a page for long: the page reads the primary
    _replica.setdefault("OPTIONS", {}).setdefault("connect_timeout", 3)
    _replica["TEST"] = {"MIRROR": "default"}
    DATABASES["replica"] = _replica
DATABASE_ROUTERS = ["billing_platform.db.ReplicaRouter"]
DATABASE_REPLICA_MAX_LAG_S = E.DATABASE_REPLICA_MAX_LAG_S
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = E.REDIS_URL
REDIS_CLUSTER_URL = E.REDIS_CLUSTER_URL  # the platform's keys on a Redis Cluster ('' = none)
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "tg",
    }
}

AUTH_USER_MODEL = "accounts.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:dashboard"
LOGOUT_REDIRECT_URL = "console:login"

# --- security ---------------------------------------------------------------------------------
# Production (TOLLGATE_ENV=production; env.py refuses to start without ALLOWED_HOSTS and the
# secrets): cookies travel over HTTPS only and browsers are told to use HTTPS for a year (HSTS,
# sent on HTTPS requests; behind a TLS-terminating proxy set TOLLGATE_SECURE_PROXY_SSL_HEADER).
SESSION_COOKIE_SECURE = E.PRODUCTION
CSRF_COOKIE_SECURE = E.PRODUCTION
SECURE_HSTS_SECONDS = E.HSTS_SECONDS
SECURE_HSTS_INCLUDE_SUBDOMAINS = E.HSTS_INCLUDE_SUBDOMAINS
SECURE_PROXY_SSL_HEADER = E.SECURE_PROXY_SSL_HEADER  # None (Django's default) unless configured
# Error pages and error e-mails mask the password of every connection URL they show.
DEFAULT_EXCEPTION_REPORTER_FILTER = "billing_platform.error_reports.UrlMaskingReporterFilter"

# Login throttle (django-axes) for the console and the admin: LOGIN_FAILURE_LIMIT failed logins
# for one username from one client address lock that pair out for the cool-off (each further
# try restarts it); other users and other addresses are unaffected; a success resets the count.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = E.LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(minutes=E.LOGIN_COOLOFF_MINUTES)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_USERNAME_FORM_FIELD = "username"  # the login form's field (it holds the e-mail)
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "billing_platform.console.login_views.login_locked_out"

# Content-Security-Policy (django-csp) on every Django page: scripts, styles and everything else
# from this site only, no inline script or style attribute (the console's behaviour lives in
# console/static/console/console.js), a nonce where a page must inline a style (invoices, whose
# one template also makes the PDF). Swagger UI loads its assets from a CDN and inlines its
# start-up script, so the API docs page is left out.
CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/api/v1/docs/"],
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF, NONCE],
        "img-src": [SELF, "data:"],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = E.STATE_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

vars().update(environ.Env.email_url_config(E.EMAIL_URL))
DEFAULT_FROM_EMAIL = E.DEFAULT_FROM_EMAIL
PUBLIC_URL = E.PUBLIC_URL
# Who may read /metrics (billing_platform/metrics.py): client networks, and a bearer token if set.
METRICS_ALLOWED_NETWORKS = E.METRICS_ALLOWED_NETWORKS
METRICS_TOKEN = E.METRICS_TOKEN

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "billing_platform.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["billing_platform.json_input.JSONParser",
                               "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "billing_platform.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tollgate management API",
    "DESCRIPTION": "Organizations, projects, API keys, members, usage and billing.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "billing_platform.api.schema.document_house_rules"],
    "ENUM_NAME_OVERRIDES": {
        "PlanKindEnum": "plans.choices.PlanKind",
        "CreditGrantKindEnum": "plans.choices.CreditGrantKind",
    },
}

# Celery: the broker and where beat keeps its state; queues, routes, every task's delivery
# options and the beat schedule are declared once, in billing_platform/celery.py.
CELERY_BROKER_URL = E.CELERY_BROKER_URL  # never the cluster: kombu's transport lacks Cluster
CELERY_RESULT_BACKEND = None
CELERY_BEAT_SCHEDULE_FILENAME = str(E.STATE_DIR / "celerybeat-schedule")
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "INFO"},
    "loggers": {"django.db.backends": {"level": "WARNING"},
                # one line per engine health probe is noise; failures still show
                "httpx": {"level": "WARNING"},
                # failed logins and lockouts (WARNING) show; its per-attempt bookkeeping not
                "axes": {"level": "WARNING"}},
}

# Gateway: largest /v1 JSON body accepted (413 above it).
GATEWAY_MAX_BODY_BYTES = 8 * 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = GATEWAY_MAX_BODY_BYTES
# Slow clients on /v1: seconds a request body may send nothing between two reads (408), and a
# response's client may read nothing (cut, its engine request aborted). docs/operations.md.
GATEWAY_BODY_READ_TIMEOUT_S = E.GATEWAY_BODY_READ_TIMEOUT_S
GATEWAY_SEND_TIMEOUT_S = E.GATEWAY_SEND_TIMEOUT_S
# The gateway's database threads keep their connection this long (gateway/db_connections.py)
GATEWAY_DB_CONN_MAX_AGE_S = E.GATEWAY_DB_CONN_MAX_AGE_S

# API keys: looked-up keys are cached in Redis this long; revocation overwrites the entry.
API_KEY_CACHE_TTL_S = 300
# A prefix no key has is cached this long (a client repeating a deleted or made-up key costs
# no query); failed authentications on /v1 are throttled per client address.
API_KEY_NEGATIVE_CACHE_TTL_S = 60
API_KEY_NEAR_CACHE = E.API_KEY_NEAR_CACHE  # each web process's own copy (keycache._Near)
AUTH_FAILURE_LIMIT = E.AUTH_FAILURE_LIMIT
AUTH_FAILURE_WINDOW_S = E.AUTH_FAILURE_WINDOW_S

# Invoicing and payments (billing_platform.invoicing).
STRIPE_API_KEY = E.STRIPE_API_KEY
STRIPE_PUBLISHABLE_KEY = E.STRIPE_PUBLISHABLE_KEY
STRIPE_WEBHOOK_SECRET = E.STRIPE_WEBHOOK_SECRET
STRIPE_API_BASE = E.STRIPE_API_BASE
STRIPE_MAX_NETWORK_RETRIES = 3       # the stripe library retries network errors with backoff
STRIPE_WEBHOOK_TOLERANCE_S = 300
INVOICING_DUNNING_DAYS = E.INVOICING_DUNNING_DAYS
INVOICING_NET_DAYS = 14             # due date of an invoice left for manual payment
INVOICING_LATE_LOOKBACK_DAYS = 62   # periods starting this far back are rescanned for late usage
INVOICING_CLOSE_CHUNK = 500         # organizations closed per transaction
INVOICING_CLOSE_WORKERS = 2         # chunks closed at once, each on its own connection
SELLER_NAME = E.SELLER_NAME          # the seller on invoices (TOLLGATE_SELLER_*)
SELLER_ADDRESS = E.SELLER_ADDRESS
SELLER_TAX_ID = E.SELLER_TAX_ID
SELLER_EMAIL = E.SELLER_EMAIL

# Reservations: self-serve purchase and renewal in the console, or a request to staff.
RESERVATIONS_SELF_SERVE = E.RESERVATIONS_SELF_SERVE

# Warehouse export (billing_platform/finance/exports.py; the beat period is in celery.py).
FINANCE_EXPORT_DIR = E.FINANCE_EXPORT_DIR
FINANCE_EXPORT_LAG_S = E.FINANCE_EXPORT_LAG_S
FINANCE_EXPORT_BACKFILL_DAYS = E.FINANCE_EXPORT_BACKFILL_DAYS

# Batch API (/v1/files, /v1/batches): OpenAI's limits, storage directory, execution knobs.
FILES_DIR = E.FILES_DIR
FILES_MAX_BYTES = 200 * 1024 * 1024
FILES_MAX_LINES = 50_000
ORG_MAX_STORED_FILES = E.ORG_MAX_STORED_FILES
ORG_MAX_STORED_BYTES = E.ORG_MAX_STORED_BYTES
FILES_DISK_RESERVE_BYTES = E.FILES_DISK_RESERVE_BYTES
BATCH_LEASE_S = E.BATCH_LEASE_S
BATCH_MAX_RUNNING_FRACTION = E.BATCH_MAX_RUNNING_FRACTION
BATCH_FREE_SLOTS = E.BATCH_FREE_SLOTS
BATCH_IDLE_S = E.BATCH_IDLE_S
BATCH_GROW_FRACTION = E.BATCH_GROW_FRACTION
BATCH_TTFT_TOLERANCE = E.BATCH_TTFT_TOLERANCE
BATCH_TTFT_WINDOW_S = E.BATCH_TTFT_WINDOW_S
BATCH_TTFT_MIN_SAMPLES = E.BATCH_TTFT_MIN_SAMPLES
TTFT_SIGNAL_FLUSH_S = E.TTFT_SIGNAL_FLUSH_S
BATCH_HOST_CPU_CEILING = E.BATCH_HOST_CPU_CEILING
BATCH_HOST_STAT = E.BATCH_HOST_STAT
BATCH_SWEEP_S = E.BATCH_SWEEP_S
BATCH_CHUNK = 64              # most lines claimed at once by one worker
BATCH_SLICE_S = 30.0          # a run task yields the worker after this long and re-enqueues
BATCH_COMPLETION_WINDOWS = {"24h": 24 * 3600}

# Gateway: output bound added when a request names none (so worst-case budget reservations are
# real bounds); priority is downgraded when every engine queues this many batches of requests.
GATEWAY_DEFAULT_MAX_TOKENS = E.GATEWAY_DEFAULT_MAX_TOKENS
GATEWAY_SATURATION_QUEUE_FACTOR = E.GATEWAY_SATURATION_QUEUE_FACTOR
# Reserved capacity held back from on-demand traffic (gateway/capacity.py).
PROVISIONED_SLOT_DECODE_TOKENS_PER_S = E.PROVISIONED_SLOT_DECODE_TOKENS_PER_S
PROVISIONED_SHARES_TTL_S = E.PROVISIONED_SHARES_TTL_S
PROVISIONED_HOLD_BACK = E.PROVISIONED_HOLD_BACK
# Responses API: days a stored answer (store: true) is kept for previous_response_id and GET.
RESPONSES_RETENTION_DAYS = E.RESPONSES_RETENTION_DAYS
# Quotas: admission reservations of crashed requests expire after this; each process caches
# limits and budgets this long, and while PostgreSQL is down serves them up to MAX_STALE_S old.
QUOTA_RESERVATION_TTL_S = E.QUOTA_RESERVATION_TTL_S
QUOTA_POLICY_TTL_S = E.QUOTA_POLICY_TTL_S
QUOTA_POLICY_MAX_STALE_S = E.QUOTA_POLICY_MAX_STALE_S
QUOTA_LEASE_MAX = E.QUOTA_LEASE_MAX
# Requests in flight per organization on /v1 (plans/concurrency.py): the default limit, and how
# long a slot lives if the process holding it dies.
ORG_MAX_CONCURRENT_REQUESTS = E.ORG_MAX_CONCURRENT_REQUESTS
ORG_CONCURRENCY_LEASE_S = E.ORG_CONCURRENCY_LEASE_S
ORG_CONCURRENCY_POOL_MAX = E.ORG_CONCURRENCY_POOL_MAX
# Budget-alert webhooks may reach non-public addresses (False: refused, see plans/webhooks.py).
WEBHOOK_ALLOW_PRIVATE_ADDRESSES = E.WEBHOOK_ALLOW_PRIVATE_ADDRESSES

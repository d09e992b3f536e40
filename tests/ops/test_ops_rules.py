"""The shipped Grafana dashboard and Prometheus alert rules work against the platform as it is.

Every metric a dashboard panel, a dashboard variable or an alert names must be on the running
platform's /metrics, where the web process, the usage consumer and a Celery worker each add
their own (prometheus_client's multi-process mode, as ``./tollgate up`` runs them). The alert
rules must be well formed (``promtool check rules`` too where promtool is installed), and each
alert must have its entry in the runbook, docs/operations.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import openai
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import live_gateway  # noqa: F401
from tests.gateway.conftest import test_database_url as database_url

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "tollgate.json"
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"
RUNBOOK = ROOT / "docs" / "operations.md"
# Series Prometheus records itself for every target it scrapes; /metrics cannot export them.
PROMETHEUS_OWN = {"up"}
# Grafana's interval variables, replaced by a duration before the query is parsed.
GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b")
PROM_DURATION = re.compile(r"(?:[0-9]+(?:ms|[smhdwy]))+")
LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")


# --- what the files reference -------------------------------------------------------------------

def metric_names(expr: str) -> set[str]:
    """Return the metric names a PromQL expression selects (every selector must name one)."""
    names: set[str] = set()
    nameless: list[str] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            else:
                nameless.append(str(node))

    promql_parser.walk(promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr)), visit)
    assert not nameless, f"{expr!r} selects by a matcher, not a metric name: {nameless}"
    return names


def _panels(panels: Iterable[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows hold their panels when collapsed


def dashboard_queries(dashboard: dict) -> list[str]:
    """Return every PromQL query of the dashboard: panel targets and query variables."""
    queries = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    assert queries, "the dashboard has no queries"
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        found = LABEL_VALUES.match(query)
        queries.append(found.group(1) if found else query)
    return queries


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def referenced_metrics() -> dict[str, set[str]]:
    """Return {metric name: where it is referenced} over the dashboard and the alerts."""
    where: dict[str, set[str]] = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for query in dashboard_queries(dashboard):
        for name in metric_names(query):
            where.setdefault(name, set()).add(f"dashboard: {query}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            where.setdefault(name, set()).add(f"alert {rule['alert']}")
    return where


def exported_metrics(text: str) -> set[str]:
    """Return the metric names an exposition declares: families (even empty) and samples."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        names.update(sample.name for sample in family.samples)
    return names


def unexported(referenced: dict[str, set[str]], exported: set[str]) -> dict[str, set[str]]:
    return {name: where for name, where in referenced.items()
            if name not in exported and name not in PROMETHEUS_OWN}


# --- the files on their own -----------------------------------------------------------------------

def test_the_check_itself_catches_a_metric_nobody_exports():
    # given a panel naming a metric that does not exist, next to one that does
    referenced = {name: {"panel"} for name in metric_names(
        "sum(rate(tollgate_gateway_requests_total[$__rate_interval])) "
        "/ sum(rate(tollgate_no_such_thing_total[5m]))")}

    # then only the missing one is reported
    exported = exported_metrics("# HELP tollgate_gateway_requests Requests.\n"
                                "# TYPE tollgate_gateway_requests counter\n"
                                'tollgate_gateway_requests_total{code=""} 1.0\n')
    assert set(unexported(referenced, exported)) == {"tollgate_no_such_thing_total"}
    # and a selector without a metric name is refused outright
    with pytest.raises(AssertionError, match="not a metric name"):
        metric_names('{__name__=~"tollgate_.*"}')


def test_alert_rules_are_well_formed_and_each_has_a_runbook_entry():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    anchors = {_anchor(line) for line in RUNBOOK.read_text().splitlines()
               if line.startswith("#")}
    assert groups and len({g["name"] for g in groups}) == len(groups)
    for group in groups:
        assert group["rules"], f"group {group['name']} is empty"
        for rule in group["rules"]:
            name = rule.get("alert")
            assert name and re.fullmatch(r"Tollgate[A-Za-z]+", name), rule
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
            promql_parser.parse(rule["expr"])  # raises on a syntax error
            assert PROM_DURATION.fullmatch(rule["for"]), f"{name}: for {rule['for']!r}"
            assert rule["labels"]["severity"] in ("critical", "warning"), name
            notes = rule["annotations"]
            assert notes["summary"] and notes["description"], name
            assert notes["runbook"] == f"docs/operations.md#{name.lower()}", name
            assert name.lower() in anchors, f"docs/operations.md has no section for {name}"
    promtool = shutil.which("promtool")
    if promtool:
        done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                              text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def _anchor(heading: str) -> str:
    """Return the anchor GitHub (and most Markdown renderers) give a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^a-z0-9 _-]", "", text).replace(" ", "-")


def test_the_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel
            for target in panel["targets"]:
                metric_names(target["expr"])


# --- against the running platform -----------------------------------------------------------------

@pytest.fixture
def metrics_dir(tmp_path) -> Path:
    path = tmp_path / "metrics"
    path.mkdir()
    return path


@pytest.fixture
def gateway_env(metrics_dir) -> dict[str, str]:
    return {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}


@pytest.fixture
def ingest_process(live_gateway, metering_stream, gateway_env, tmp_path  # noqa: F811
                   ) -> Iterator[subprocess.Popen]:
    """The usage consumer (``manage.py ingest_usage``) as ``./tollgate up`` runs it."""
    log_path = tmp_path / "ingest.log"
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "ingest_usage", "--block-ms", "100"], cwd=ROOT,
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        env={**os.environ, "DATABASE_URL": database_url(), **metering_stream,
             **gateway_env})
    yield proc
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _scrape(gateway) -> str:
    response = httpx.get(f"{gateway.url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def _value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_every_metric_the_dashboard_and_alerts_use_is_exported(
        live_gateway, ingest_process, celery_worker_process, gateway_env, metering_stream):  # noqa: F811
    # given the web process, the usage consumer and a billing worker sharing one metrics dir
    worker = celery_worker_process(queues="billing", env={**gateway_env, **metering_stream})
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org))
    client = openai.OpenAI(base_url=f"{live_gateway.url}/v1", api_key=secret, max_retries=0)

    # when a request is served and metered, one is refused, and the billing check runs
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5)
    request_id = raw.headers["x-request-id"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live_gateway.url}/v1", api_key="sk-wrong",
                      max_retries=0).models.list()
    wait_until(lambda: UsageEvent.objects.filter(request_id=request_id).exists(), timeout=90,
               what="the usage consumer to record the request")
    from billing_platform.invoicing.tasks import billing_invariant_task

    billing_invariant_task.delay()

    def checked() -> bool:
        return _value(_scrape(live_gateway), "tollgate_celery_tasks_total",
                      task="invoicing.billing_invariant", state="success") == 1.0

    wait_until(checked, timeout=120,
               what=f"the worker to run the billing check (log: {worker.log_path})")
    text = _scrape(live_gateway)  # Django's own metrics count the scrapes before this one

    # then each process's metrics are on the web process's page
    assert _value(text, "tollgate_gateway_requests_total", endpoint="v1-chat-completions",
                  status="200") == 1.0  # the web process
    assert _value(text, "tollgate_gateway_requests_total", status="401",
                  code="invalid_api_key") == 1.0
    event = UsageEvent.objects.get(request_id=request_id)
    assert _value(text, "tollgate_usage_tokens_total", model="small",
                  token_class="output") == event.completion_tokens  # the usage consumer
    assert _value(text, "tollgate_usage_events_total", model="small", status="ok") == 1.0
    assert _value(text, "tollgate_billing_invariant_orgs") == 0.0  # the worker, via Redis
    assert _value(text, "tollgate_ingest_backlog_events") == 0.0
    # and every metric a panel, a variable or an alert names is among them
    missing = unexported(referenced_metrics(), exported_metrics(text))
    assert not missing, "referenced but not exported:\n" + "\n".join(
        f"  {name}: {sorted(where)}" for name, where in sorted(missing.items()))

"""Budgets: monthly spend limits per org and project, their alerts, the reconciling sweep.

PostgreSQL holds what was configured and what was rated (the truth); Redis holds the live
counters admission uses (see ``plans.admission``; rate limits are ``plans.limits``). The beat
sweep reconciles them: Redis spend is raised to PostgreSQL's when it is behind (a lost or
flushed Redis), never lowered (Redis is ahead by the events not yet ingested); alerts fire once
per threshold per period; exhausted hard budgets suspend their keys, and a raised budget
reinstates them.

An alert's email goes out from the sweep; its webhook from a worker after the alert commits,
with retries (``plans.webhooks``, where the signature scheme is documented).
"""

from __future__ import annotations

import logging
import secrets
import smtplib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.utils import timezone

from billing_platform.accounts.models import Organization, Project
from billing_platform.audit.services import audit_record
from billing_platform.errors import InvalidRequest
from metering.events import MAX_USER, is_end_user
from metering.selectors import end_user_spend, rated_spend
from plans import admission
from plans.admission import scripts
from plans.models import Budget, BudgetAlert, EndUserBudget
from plans.periods import month_bounds
from plans.webhooks import budget_alert_emit, budget_alert_webhook_enqueue, webhook_url_check

log = logging.getLogger(__name__)

DEFAULT_THRESHOLDS = [50, 80, 100]
# Each threshold is an alert (an email and a webhook) per period: a budget has a few, not many.
MAX_THRESHOLDS = 10
MAX_ALERT_EMAILS = 10


@dataclass(frozen=True)
class BudgetState:
    budget: Budget
    period_start: datetime
    pg_spend: Decimal
    live_spend: Decimal  # max(Redis settled spend, PostgreSQL)
    reserved: Decimal

    @property
    def percent(self) -> Decimal:
        return (self.live_spend * 100 / self.budget.amount).quantize(Decimal("0.01"))


def budget_state(*, budget: Budget, at: datetime | None = None) -> BudgetState:
    """Return a budget's spend this month (PostgreSQL and live) and what is reserved now."""
    from billing_platform.redis_conn import get_redis

    at = at or timezone.now()
    start, end = month_bounds(at)
    pg = rated_spend(organization_id=budget.organization_id, project_id=budget.project_id,
                     start=start, end=end)
    raw = get_redis().hmget(admission.budget_key(budget.organization_id, budget.id, at),
                            "spent", "reserved")
    live = max(pg, admission.from_micro(raw[0])) if raw[0] is not None else pg
    reserved = admission.from_micro(raw[1]) if raw[1] is not None else Decimal("0")
    return BudgetState(budget, start, pg, live, reserved)


def budgets_of(*, organization: Organization) -> list[Budget]:
    return list(Budget.objects.filter(organization=organization)
                .select_related("project").order_by("project_id"))


# --- services ------------------------------------------------------------------------------

def _audit(*, organization_id: int, action: str, subject: str = "",
           details: dict[str, Any] | None = None, actor: Any = None) -> None:
    """Write the action's audit row; call it inside the action's own transaction."""
    audit_record(acting_user=actor, organization=organization_id, action=action,
                 target=subject, after=details or {})


def budget_set(*, organization: Organization, project: Project | None = None,
               amount: Decimal | str, hard: bool = True,
               thresholds: Iterable[int] | None = None, alert_emails: Iterable[str] = (),
               webhook_url: str = "", actor: Any = None) -> Budget:
    """Create or change the monthly budget of an org or project; reinstate if now under it."""
    amount = Decimal(str(amount))
    if not amount.is_finite() or amount <= 0:
        raise InvalidRequest("'amount' must be a positive decimal.", param="amount")
    levels = sorted(set(thresholds if thresholds is not None else DEFAULT_THRESHOLDS))
    if not levels or any(t < 1 or t > 1000 for t in levels):
        raise InvalidRequest("'thresholds' must be percentages from 1 to 1000.",
                             param="thresholds")
    if len(levels) > MAX_THRESHOLDS:
        raise InvalidRequest(f"A budget has at most {MAX_THRESHOLDS} alert thresholds.",
                             param="thresholds")
    alert_emails = list(alert_emails)
    if len(alert_emails) > MAX_ALERT_EMAILS:
        raise InvalidRequest(f"A budget alerts at most {MAX_ALERT_EMAILS} email addresses.",
                             param="alert_emails")
    webhook_url_check(url=webhook_url)
    with transaction.atomic():
        budget = Budget.objects.select_for_update().filter(
            organization=organization, project=project).first()
        created = budget is None
        if budget is None:
            budget = Budget(organization=organization, project=project,
                            currency=organization.currency,
                            webhook_secret=f"whsec_{secrets.token_hex(24)}")
        before = str(budget.amount) if not created else None
        budget.amount, budget.hard, budget.thresholds = amount, hard, levels
        budget.alert_emails = alert_emails
        budget.webhook_url = webhook_url
        budget.updated_at = timezone.now()
        budget.save()
        _audit(organization_id=organization.id, action="budget.set", subject=budget.public_id,
               details={"amount": str(amount), "previous": before, "hard": hard,
                        "thresholds": levels}, actor=actor)
    _apply_suspension(budget_state(budget=budget))
    return budget


@transaction.atomic
def budget_delete(*, budget: Budget, actor: Any = None) -> None:
    """Remove a budget (its keys are no longer limited by it)."""
    _audit(organization_id=budget.organization_id, action="budget.delete",
           subject=budget.public_id, actor=actor)
    budget.delete()


def _email_alert(alert: BudgetAlert, state: BudgetState) -> None:
    budget = state.budget
    org = budget.organization
    who = (f"project {budget.project.name}" if budget.project is not None
           else f"organization {org.name}")
    subject = (f"[Tollgate] {who} reached {alert.threshold}% of its monthly budget "
               f"({state.live_spend.quantize(Decimal('0.01'))} of {budget.amount} "
               f"{budget.currency})")
    recipients = budget.alert_emails or [org.billing_email]
    try:
        send_mail(subject, f"{subject}.\n\nPeriod: {alert.period_start:%Y-%m}.\n"
                  f"{'Requests are refused at 100% (hard budget).' if budget.hard else ''}",
                  None, recipients)
    except (OSError, smtplib.SMTPException) as exc:
        # Recorded without email_sent_at, so it is visible; the webhook still goes out.
        log.warning("budget alert email for %s failed: %r", budget.public_id, exc)
    else:
        alert.email_sent_at = timezone.now()
        alert.save(update_fields=["email_sent_at"])


def _apply_suspension(state: BudgetState) -> str:
    budget = state.budget
    exhausted = budget.hard and state.live_spend >= budget.amount
    if exhausted == (budget.suspended_at is not None):
        return ""
    with transaction.atomic():
        budget.suspended_at = timezone.now() if exhausted else None
        budget.save(update_fields=["suspended_at"])
        _audit(organization_id=budget.organization_id,
               action="keys.suspended" if exhausted else "keys.reinstated",
               subject=budget.public_id, details={"spend": str(state.live_spend),
                                                  "amount": str(budget.amount)})
    return "suspended" if exhausted else "reinstated"


def budget_reconcile(*, budget: Budget, at: datetime | None = None) -> dict[str, Any]:
    """Fix Redis drift for one budget, fire due alerts once, suspend or reinstate its keys."""
    from billing_platform.redis_conn import get_redis

    at = at or timezone.now()
    r = get_redis()
    r.eval(scripts.PURGE_LUA, 1, admission.reservations_key(budget.organization_id))
    key = admission.budget_key(budget.organization_id, budget.id, at)
    start, end = month_bounds(at)
    pg = rated_spend(organization_id=budget.organization_id, project_id=budget.project_id,
                     start=start, end=end)
    raw = r.hget(key, "spent")
    fixed = False
    if raw is None or admission.from_micro(raw) < pg:
        # Redis lost spend (restart, flush): PostgreSQL is the truth. Max, never lower.
        r.eval(scripts.RAISE_SPENT_LUA, 1, key, admission.to_micro(pg))
        fixed = raw is not None
        if raw is not None:
            with transaction.atomic():  # the fix itself is in Redis: the row is all there is
                _audit(organization_id=budget.organization_id, action="budget.drift_fixed",
                       subject=budget.public_id,
                       details={"redis": str(admission.from_micro(raw)), "postgres": str(pg)})
    state = budget_state(budget=budget, at=at)
    fired = []
    for threshold in budget.thresholds:
        if state.live_spend * 100 < budget.amount * threshold:
            continue
        try:
            with transaction.atomic():
                alert = BudgetAlert.objects.create(budget=budget, period_start=start,
                                                   threshold=threshold, spend=state.live_spend)
                _audit(organization_id=budget.organization_id, action="budget.alert",
                       subject=budget.public_id,
                       details={"threshold": threshold, "spend": str(state.live_spend)})
                if budget.webhook_url:
                    budget_alert_webhook_enqueue(alert=alert)  # sent once this commits
                budget_alert_emit(alert=alert)  # and to the organization's endpoints
        except IntegrityError:
            continue  # already fired this period
        _email_alert(alert, state)
        fired.append(threshold)
    change = _apply_suspension(state)
    return {"fired": fired, "drift_fixed": fixed, "change": change,
            "spend": str(state.live_spend)}


def budget_sweep() -> dict[str, Any]:
    """Reconcile every budget (the beat task)."""
    results = {}
    for budget in Budget.objects.select_related("organization", "project"):
        results[budget.public_id] = budget_reconcile(budget=budget)
    return results


# --- per-end-user budgets ------------------------------------------------------------------

# An organization's end users with a budget of their own (besides its default): each row is
# held in every cached policy of the organization, so their number is bounded.
MAX_END_USER_BUDGETS = 10_000


def end_user_budgets_of(*, organization: Organization, end_user: str | None = None
                        ) -> QuerySet[EndUserBudget]:
    """Return the organization's end-user budgets (the default first), or the one of
    ``end_user``."""
    rows = EndUserBudget.objects.filter(organization=organization)
    if end_user is not None:
        rows = rows.filter(end_user=end_user)
    named = ExpressionWrapper(Q(end_user__isnull=False), output_field=BooleanField())
    return rows.annotate(named=named).order_by("named", "id")


def end_user_spend_now(*, budget: EndUserBudget, at: datetime | None = None) -> Decimal | None:
    """Return the end user's spend this month (max of Redis's live count and PostgreSQL's
    rated events); None for the default, which limits each end user apart."""
    from billing_platform.redis_conn import get_redis

    if budget.end_user is None:
        return None
    at = at or timezone.now()
    start, end = month_bounds(at)
    pg = end_user_spend(organization_id=budget.organization_id, end_user=budget.end_user,
                        start=start, end=end)
    rule = admission.end_user_rule(budget_id=budget.id, limit=budget.amount,
                                   end_user=budget.end_user)
    raw = get_redis().hget(admission.rule_key(budget.organization_id, rule, f"{at:%Y%m}"),
                           "spent")
    return max(pg, admission.from_micro(raw)) if raw is not None else pg


def end_user_budget_set(*, organization: Organization, end_user: str | None,
                        amount: Decimal | str, acting_user: Any) -> EndUserBudget:
    """Create or change the hard monthly budget of one end user (``end_user`` as requests
    name it in ``user``), or with None the default for each end user without one.

    Admission enforces it within the policy cache's TTL (``POLICY_TTL_S``); spend already
    made this month counts against a new or lowered amount.
    """
    amount = Decimal(str(amount))
    if not amount.is_finite() or amount <= 0:
        raise InvalidRequest("'amount' must be a positive decimal.", param="amount")
    if end_user is not None and (not is_end_user(end_user) or not end_user):
        raise InvalidRequest(f"'end_user' must be a non-empty string of at most {MAX_USER} "
                             "characters, without tabs, line breaks, backslashes or NUL "
                             "(as a request's 'user'), or null for the default.",
                             param="end_user")
    with transaction.atomic():
        # the organization's row serializes its budgets' creation (the count below)
        Organization.objects.select_for_update().filter(pk=organization.pk).first()
        rows = EndUserBudget.objects.filter(organization=organization)
        budget = (rows.filter(end_user=end_user) if end_user is not None
                  else rows.filter(end_user__isnull=True)).first()
        before = None if budget is None else str(budget.amount)
        if budget is None:
            if end_user is not None and EndUserBudget.objects.filter(
                    organization=organization).count() >= MAX_END_USER_BUDGETS:
                raise InvalidRequest(f"An organization has at most {MAX_END_USER_BUDGETS} "
                                     "end-user budgets; set a default for the rest.",
                                     param="end_user")
            budget = EndUserBudget(organization=organization, end_user=end_user,
                                   currency=organization.currency)
        budget.amount, budget.updated_at = amount, timezone.now()
        budget.save()
        audit_record(acting_user=acting_user, organization=organization,
                     action="end_user_budget.set", target=budget.public_id,
                     before=None if before is None else {"amount": before},
                     after={"end_user": end_user, "amount": str(amount)})
    return budget


@transaction.atomic
def end_user_budget_delete(*, budget: EndUserBudget, acting_user: Any) -> None:
    """Remove an end-user budget (that end user falls back to the default, if any)."""
    audit_record(acting_user=acting_user, organization=budget.organization_id,
                 action="end_user_budget.delete", target=budget.public_id,
                 before={"end_user": budget.end_user, "amount": str(budget.amount)})
    budget.delete()

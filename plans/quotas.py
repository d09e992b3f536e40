"""Quotas: rate limits per org/project/key, monthly budgets, alerts, the reconciling sweep.

PostgreSQL holds what was configured and what was rated (the truth); Redis holds the live
counters admission uses (see ``plans.admission``). The beat sweep reconciles them: Redis spend
is raised to PostgreSQL's when it is behind (a lost or flushed Redis), never lowered (Redis is
ahead by the events not yet ingested); alerts fire once per threshold per period; exhausted hard
budgets suspend their keys, and a raised budget reinstates them.

An alert's email goes out from the sweep; its webhook from a worker after the alert commits,
with retries (``plans.webhooks``, where the signature scheme is documented).
"""

from __future__ import annotations

import logging
import secrets
import smtplib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Organization, Project
from billing_platform.accounts.selectors import authority_of
from billing_platform.audit.services import audit_record
from billing_platform.errors import Forbidden, InvalidRequest
from metering.selectors import rated_spend
from plans import admission
from plans.admission import scripts
from plans.models import Budget, BudgetAlert, QuotaLimit, Subscription
from plans.webhooks import budget_alert_webhook_enqueue, webhook_url_check

log = logging.getLogger(__name__)

# Default organization limits by usage tier (requests and tokens per minute), like OpenAI's
# tiers. A self-hosted fleet starts orgs at tier-3 so development is not throttled.
USAGE_TIERS: dict[str, tuple[int, int]] = {
    "free": (3, 40_000),
    "tier-1": (500, 200_000),
    "tier-2": (5_000, 2_000_000),
    "tier-3": (5_000, 4_000_000),
    "tier-4": (10_000, 10_000_000),
    "tier-5": (30_000, 150_000_000),
}
DEFAULT_USAGE_TIER = "tier-3"
DEFAULT_THRESHOLDS = [50, 80, 100]
# Each threshold is an alert (an email and a webhook) per period: a budget has a few, not many.
MAX_THRESHOLDS = 10
MAX_ALERT_EMAILS = 10


def month_bounds(at: datetime) -> tuple[datetime, datetime]:
    """Return the calendar month [start, end) of ``at`` in UTC."""
    at = at.astimezone(UTC)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    end = datetime(at.year + (at.month == 12), at.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


# --- selectors -----------------------------------------------------------------------------

def limits_of(*, organization_id: int, project_id: int, key_id: int
              ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...],
                         frozenset[str] | None]:
    """Return the (rpm, tpm) limits per scope and the region narrowing for one key."""
    rows = {row.scope: row for row in QuotaLimit.objects.filter(
        Q(organization_id=organization_id, project__isnull=True, api_key__isnull=True)
        | Q(project_id=project_id, api_key__isnull=True) | Q(api_key_id=key_id))}
    org = rows.get("organization")
    tier_rpm, tier_tpm = USAGE_TIERS[(org.usage_tier if org and org.usage_tier
                                      else DEFAULT_USAGE_TIER)]
    rpm = [(f"o{organization_id}", org.rpm if org and org.rpm is not None else tier_rpm)]
    tpm = [(f"o{organization_id}", org.tpm if org and org.tpm is not None else tier_tpm)]
    regions: frozenset[str] | None = None
    for scope, tag in (("project", f"p{project_id}"), ("key", f"k{key_id}")):
        row = rows.get(scope)
        if row is None:
            continue
        if row.rpm is not None:
            rpm.append((tag, row.rpm))
        if row.tpm is not None:
            tpm.append((tag, row.tpm))
        if row.allowed_regions:
            mine = frozenset(row.allowed_regions)
            regions = mine if regions is None else regions & mine
    if org and org.allowed_regions:
        mine = frozenset(org.allowed_regions)
        regions = mine if regions is None else regions & mine
    return tuple(rpm), tuple(tpm), regions


def _pricing_for(org: Organization, sub: Subscription | None, model: str, at: datetime) -> Any:
    from plans.models import PriceBook
    from plans.pricing import PriceIndex

    book_id = sub.plan.price_book_id if sub is not None and sub.plan.price_book_id else None
    if book_id is None:
        currency = sub.plan.currency if sub is not None else org.currency
        book_id = (PriceBook.objects.filter(is_default=True, currency=currency)
                   .values_list("id", flat=True).first())
    if book_id is None:
        return None
    times, pricings = PriceIndex({book_id}, {model}, at, at).series(book_id, model)
    candidates = [p for t, p in zip(times, pricings, strict=True) if t <= at]
    return candidates[-1] if candidates else None


def _plan_exhausted(sub: Subscription | None, at: datetime) -> str:
    from plans.choices import CapPolicy
    from plans.selectors import token_plan_status

    if sub is None:
        return ""
    status = token_plan_status(subscription=sub, at=at)
    if status is None or status.cap_policy != CapPolicy.BLOCK or status.credits_left > 0:
        return ""
    if status.window_credits is not None and status.window_used >= status.window_credits:
        return f"the {status.window_hours}-hour window's credits are used up"
    return "this period's credits are used up"


def _plan_rule(sub: Subscription | None, model: str, at: datetime) -> admission.BudgetRule | None:
    """Return a blocking token plan's period credits as an admission rule (None otherwise)."""
    from plans.choices import ANY_MODEL, CapPolicy, PlanKind
    from plans.models import CreditCoefficient, TokenPlanPeriod
    from plans.periods import period_bounds
    from plans.selectors import token_plan_status

    if (sub is None or sub.plan.kind != PlanKind.TOKEN_PLAN
            or sub.plan.cap_policy != CapPolicy.BLOCK or not sub.plan.credits_per_period):
        return None
    coefs: dict[str, dict[str, Decimal]] = {}
    for m, cls, c in CreditCoefficient.objects.filter(plan=sub.plan).values_list(
            "model", "token_class", "coefficient"):
        coefs.setdefault(m, {})[cls] = c
    mine = coefs.get(model) or coefs.get(ANY_MODEL)
    if not mine:
        return None  # the model is not on the plan: rated on demand, nothing to block
    zero = Decimal("0")
    start, _end = period_bounds(sub.billing_anchor, at)
    period = TokenPlanPeriod.objects.filter(subscription=sub, period_start=start).first()
    used = (period.plan_credits + period.pack_credits) if period else zero
    status = token_plan_status(subscription=sub, at=at)
    packs = status.pack_credits_left if status else zero
    return admission.BudgetRule(
        budget_id=sub.id, scope="plan", hard=True, suspended=False,
        limit=sub.plan.credits_per_period + packs + (period.pack_credits if period else zero),
        spent_seed=used, period_tag=f"{start:%Y%m%d%H}",
        coefficients=(mine.get("input", zero), mine.get("cached_input", zero),
                      mine.get("output", zero)))


def _window_rule(sub: Subscription | None, model: str, at: datetime) -> admission.WindowRule | None:
    """Return a blocking token plan's rolling window as an admission rule (None otherwise).

    The limit adds the credit packs left, as the period rule does: past the window's room the
    ledger draws on packs before blocking. The seed is the ledger's plan credits per minute
    still in the window, used by Redis only when it holds no window for the subscription.
    """
    from django.db.models.functions import TruncMinute

    from plans.choices import ANY_MODEL, CapPolicy, PlanKind
    from plans.models import CreditCoefficient, TokenPlanUsage
    from plans.selectors import token_plan_status

    if (sub is None or sub.plan.kind != PlanKind.TOKEN_PLAN
            or sub.plan.cap_policy != CapPolicy.BLOCK or sub.plan.window_credits is None):
        return None
    coefs: dict[str, dict[str, Decimal]] = {}
    for m, cls, c in CreditCoefficient.objects.filter(plan=sub.plan).values_list(
            "model", "token_class", "coefficient"):
        coefs.setdefault(m, {})[cls] = c
    mine = coefs.get(model) or coefs.get(ANY_MODEL)
    if not mine:
        return None
    zero = Decimal("0")
    hours = sub.plan.window_hours
    rows = (TokenPlanUsage.objects
            .filter(subscription=sub, event_time__gt=at - timedelta(hours=hours),
                    event_time__lte=at, plan_credits__gt=0)
            .annotate(minute=TruncMinute("event_time")).values("minute")
            .annotate(credits=Sum("plan_credits")).values_list("minute", "credits"))
    seed = tuple(sorted((int(minute.timestamp()) // 60, admission.to_micro(credits))
                        for minute, credits in rows))
    status = token_plan_status(subscription=sub, at=at)
    packs = status.pack_credits_left if status else zero
    return admission.WindowRule(
        subscription_id=sub.id, hours=hours, limit=sub.plan.window_credits + packs,
        coefficients=(mine.get("input", zero), mine.get("cached_input", zero),
                      mine.get("output", zero)), seed=seed)


def _provisioned_for(org_id: int, model: str, at: datetime) -> admission.ProvisionedRule | None:
    from plans.choices import OverflowPolicy
    from plans.selectors import active_reservations

    r = active_reservations(organization_id=org_id, at=at).filter(model=model).first()
    if r is None:
        return None
    return admission.ProvisionedRule(
        reservation_id=r.id, region=r.region,
        tokens_per_minute=r.units * r.tokens_per_minute_per_unit,
        cache_burndown=r.cache_burndown, output_burndown=r.output_burndown,
        reject_overflow=r.overflow_policy == OverflowPolicy.REJECT)


def quota_policy_load(*, organization_id: int, project_id: int, key_id: int, model: str
                      ) -> admission.QuotaPolicy:
    """Return what admission enforces for one key and model, read from PostgreSQL."""
    from plans.selectors import subscription_at

    now = timezone.now()
    org = Organization.objects.get(pk=organization_id)
    rpm, tpm, regions = limits_of(organization_id=organization_id, project_id=project_id,
                                  key_id=key_id)
    start, end = month_bounds(now)
    budgets = []
    for b in Budget.objects.filter(Q(organization_id=organization_id, project__isnull=True)
                                   | Q(project_id=project_id)).order_by("project_id"):
        scope = "project" if b.project_id else "organization"
        budgets.append(admission.BudgetRule(
            budget_id=b.id, scope=scope, limit=b.amount, hard=b.hard,
            spent_seed=rated_spend(organization_id=organization_id, project_id=b.project_id,
                                   start=start, end=end),
            suspended=b.suspended_at is not None))
    # org budget first, then the project's (the order of the spend-limit codes' precedence)
    budgets.sort(key=lambda b: b.scope != "organization")
    sub = subscription_at(organization=org, at=now)  # read once: four rules depend on it
    plan_rule = _plan_rule(sub, model, now)
    if plan_rule is not None:
        budgets.append(plan_rule)
    return admission.QuotaPolicy(
        org_id=organization_id, project_id=project_id, key_id=key_id, rpm=rpm, tpm=tpm,
        budgets=tuple(budgets), pricing=_pricing_for(org, sub, model, now),
        allowed_regions=regions, provisioned=_provisioned_for(organization_id, model, now),
        plan_exhausted=_plan_exhausted(sub, now), currency=org.currency,
        window=_window_rule(sub, model, now))


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


def limits_rows_of(*, organization: Organization) -> list[QuotaLimit]:
    return list(QuotaLimit.objects.filter(organization=organization)
                .select_related("project", "api_key").order_by("project_id", "api_key_id"))


# --- services ------------------------------------------------------------------------------

def _audit(*, organization_id: int, action: str, subject: str = "",
           details: dict[str, Any] | None = None, actor: Any = None) -> None:
    with transaction.atomic():  # a savepoint inside the action's transaction, if any
        audit_record(acting_user=actor, organization=organization_id, action=action,
                     target=subject, after=details or {})


STAFF_ROLE = "staff"  # ``QuotaLimit.set_by_role`` of rows staff or the system set


def _limit_target(organization: Organization, project: Project | None,
                  api_key: ApiKey | None) -> str:
    return (api_key.public_id if api_key else project.public_id if project
            else organization.public_id)


def _limit_state(row: QuotaLimit | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"rpm": row.rpm, "tpm": row.tpm, "usage_tier": row.usage_tier,
            "allowed_regions": list(row.allowed_regions), "set_by_role": row.set_by_role}


def _limit_lookup(organization: Organization, project: Project | None,
                  api_key: ApiKey | None) -> dict[str, Any]:
    if api_key is not None:
        return {"organization": organization, "api_key": api_key}
    if project is not None:
        return {"organization": organization, "project": project, "api_key__isnull": True}
    return {"organization": organization, "project__isnull": True, "api_key__isnull": True}


def _check_limit_authority(*, authority: Any, row: QuotaLimit | None,
                           project: Project | None, api_key: ApiKey | None) -> None:
    """Refuse a change of this scope's limits that the actor's role may not make.

    The org's limits need ``org.write``, a project's ``projects.write``, a key's
    ``keys.write`` and, below ``org.write``, a key the actor made. A row that an owner,
    admin or staff set (or one from before this was recorded) is changed or removed only with
    ``org.write``: a developer cannot lift a limit an admin put on their key.
    """
    needed = "keys.write" if api_key else "projects.write" if project else "org.write"
    if not authority.can(needed):
        raise Forbidden(f"Your role ({authority.role or 'none'}) cannot change these limits "
                        f"({needed}).")
    if authority.can("org.write"):
        return
    if api_key is not None and (authority.person is None
                                or api_key.created_by_id != authority.person.pk):
        raise Forbidden("Only an owner or admin can change the limits of a key someone else "
                        "made.")
    if row is not None and row.set_by_role not in _LOWER_ROLES:
        raise Forbidden(f"These limits were set by {row.set_by_role or 'an admin'}; only an "
                        "owner or admin can change or remove them.")


_LOWER_ROLES = frozenset({Role.DEVELOPER, Role.FINANCE, Role.VIEWER})


def _tier_ceiling(organization: Organization, tier: str) -> dict[str, int]:
    """Return the highest rpm and tpm a customer may set: the tier's, or the org's own limits
    where staff set them higher."""
    rpm, tpm = USAGE_TIERS[tier or DEFAULT_USAGE_TIER]
    org_row = QuotaLimit.objects.filter(**_limit_lookup(organization, None, None)).first()
    if org_row is not None:
        rpm = max(rpm, org_row.rpm or 0)
        tpm = max(tpm, org_row.tpm or 0)
    return {"rpm": rpm, "tpm": tpm}


def quota_limit_set(*, organization: Organization, project: Project | None = None,
                    api_key: ApiKey | None = None, rpm: int | None = None,
                    tpm: int | None = None, usage_tier: str | None = None,
                    allowed_regions: Iterable[str] = (), acting_user: Any = None
                    ) -> QuotaLimit:
    """Create or replace the limits of an org, a project or a key (null: inherit/none).

    Customers may set limits at or below their usage tier's ceiling, on the scopes their
    role may change (``_check_limit_authority``); the usage tier itself is set by Tollgate
    staff (``usage_tier=None`` keeps it). Staff and the system (no actor) are not bound.
    """
    if usage_tier and usage_tier not in USAGE_TIERS:
        raise InvalidRequest(f"Unknown usage tier {usage_tier!r}; one of "
                             f"{', '.join(USAGE_TIERS)}.", param="usage_tier")
    if usage_tier and (project or api_key):
        raise InvalidRequest("A usage tier is set on the organization only.",
                             param="usage_tier")
    for name, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None and value < 0:
            raise InvalidRequest(f"'{name}' must be a non-negative integer.", param=name)
    if api_key is not None:
        project = None
    regions = sorted(set(allowed_regions))
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    with transaction.atomic():
        row = QuotaLimit.objects.select_for_update().filter(
            **_limit_lookup(organization, project, api_key)).first()
        _check_limit_authority(authority=authority, row=row, project=project, api_key=api_key)
        before = _limit_state(row)
        current_tier = row.usage_tier if row is not None else ""
        tier = current_tier if usage_tier is None else usage_tier
        if tier != current_tier and not authority.unrestricted:
            raise Forbidden("The usage tier is set by Tollgate staff (it follows your payment "
                            "history); ask support to change it.", param="usage_tier")
        if not authority.unrestricted:
            org_tier = tier if project is None and api_key is None else (
                QuotaLimit.objects.filter(**_limit_lookup(organization, None, None))
                .values_list("usage_tier", flat=True).first() or "")
            ceiling = _tier_ceiling(organization, org_tier)
            for name, value in (("rpm", rpm), ("tpm", tpm)):
                unchanged = row is not None and getattr(row, name) == value
                if value is not None and value > ceiling[name] and not unchanged:
                    raise InvalidRequest(
                        f"'{name}' may be at most {ceiling[name]:,} on usage tier "
                        f"{org_tier or DEFAULT_USAGE_TIER}; ask Tollgate to raise your tier.",
                        param=name)
        if row is None:
            row = QuotaLimit(organization=organization, project=project, api_key=api_key)
        row.rpm, row.tpm, row.usage_tier = rpm, tpm, tier
        row.allowed_regions, row.updated_at = regions, timezone.now()
        row.set_by_role = STAFF_ROLE if authority.unrestricted else authority.role or ""
        row.save()
        audit_record(acting_user=acting_user, organization=organization, action="limits.set",
                     target=_limit_target(organization, project, api_key), before=before,
                     after=_limit_state(row))
    return row


def quota_limit_delete(*, organization: Organization, project: Project | None = None,
                       api_key: ApiKey | None = None, acting_user: Any = None) -> bool:
    """Remove the limits of a project or a key (they inherit again); return whether any were
    set. The same role rules as ``quota_limit_set`` apply."""
    if project is None and api_key is None:
        raise InvalidRequest("The organization's limits are changed, not removed.")
    if api_key is not None:
        project = None
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    with transaction.atomic():
        row = QuotaLimit.objects.select_for_update().filter(
            **_limit_lookup(organization, project, api_key)).first()
        _check_limit_authority(authority=authority, row=row, project=project, api_key=api_key)
        if row is None:
            return False
        audit_record(acting_user=acting_user, organization=organization,
                     action="limits.delete", target=_limit_target(organization, project,
                                                                  api_key),
                     before=_limit_state(row))
        row.delete()
    return True


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
        if created:
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


def budget_delete(*, budget: Budget, actor: Any = None) -> None:
    """Remove a budget (its keys are no longer limited by it)."""
    _audit(organization_id=budget.organization_id, action="budget.delete",
           subject=budget.public_id, actor=actor)
    budget.delete()


def _email_alert(alert: BudgetAlert, state: BudgetState) -> None:
    budget = state.budget
    org = budget.organization
    who = f"project {budget.project.name}" if budget.project_id else f"organization {org.name}"
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
    if exhausted and budget.suspended_at is None:
        budget.suspended_at = timezone.now()
        budget.save(update_fields=["suspended_at"])
        _audit(organization_id=budget.organization_id, action="keys.suspended",
               subject=budget.public_id, details={"spend": str(state.live_spend),
                                                  "amount": str(budget.amount)})
        return "suspended"
    if not exhausted and budget.suspended_at is not None:
        budget.suspended_at = None
        budget.save(update_fields=["suspended_at"])
        _audit(organization_id=budget.organization_id, action="keys.reinstated",
               subject=budget.public_id, details={"spend": str(state.live_spend),
                                                  "amount": str(budget.amount)})
        return "reinstated"
    return ""


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
        if fixed:
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
                if budget.webhook_url:
                    budget_alert_webhook_enqueue(alert=alert)  # sent once this commits
        except IntegrityError:
            continue  # already fired this period
        _audit(organization_id=budget.organization_id, action="budget.alert",
               subject=budget.public_id,
               details={"threshold": threshold, "spend": str(state.live_spend)})
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

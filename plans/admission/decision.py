"""The decision of one request, in Python: estimates, the script's arguments, headers, the 429.

Why a module of its own: the Lua in ``scripts`` decides, but everything it is told and
everything it answers is built and read here, with no IO: what a request may cost at worst
(``worst_case_micro``) and what it did cost (``actual_micro``), the KEYS and ARGV of an
admission (``admit_op``) and of its settlement (``Ticket.settle_op``), OpenAI's
``x-ratelimit-*`` headers, and the words and code of each 429. ``runtime`` sends what this
module builds; tests can check a decision's arguments and texts without Redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING

from plans.admission.policy import (
    MICRO,
    RESERVATION_TTL_MS,
    BudgetRule,
    QuotaExceeded,
    QuotaPolicy,
    month_tag,
    prov_key,
    reservations_key,
    to_micro,
    window_key,
)
from plans.admission.wire import Frame, Op, bulk, ints
from plans.pricing import (
    ModelPricing,
    TokenCounts,
    class_units,
    exact_lines,
    normalized_tokens,
    rounded_lines,
    units_in_last_places,
)

if TYPE_CHECKING:
    from plans.admission.lease import Lease

# One ARGV value of a script call (Redis receives every value as a string), and one value of
# a script's answer (integers, or strings as bytes or text).
Arg = str | int
RedisValue = int | str | bytes

# --- estimates ------------------------------------------------------------------------------

def prompt_token_bound(prompt_text: str, messages: int) -> int:
    """Return an upper bound of the prompt's tokens: a token is at least one UTF-8 byte.

    The chat template adds a few tokens per message (ChatML: ``<|im_start|>role\\n ...
    <|im_end|>\\n``) and the assistant prefix; 8 per message and 8 more cover it.
    """
    return len(prompt_text.encode()) + 8 * max(messages, 1) + 8


# Per (pricing, prompt band, tier, zone): what a token of each class costs, as whole numbers
# of 1e-10 (``units_in_last_places``), or None when some price times its multipliers is finer
# (then the Decimal path below). Keyed by the pricing's id and holding the pricing itself, so
# an id reused by a newer object is told apart; cleared when large (policies reload, and each
# reload makes new pricing objects).
_UnitsKey = tuple[int, int, str, str]
_units: dict[_UnitsKey, tuple[ModelPricing, tuple[int, ...] | None]] = {}
_worst: dict[_UnitsKey, tuple[ModelPricing, tuple[int, int] | None]] = {}


def _band(pricing: ModelPricing, prompt_tokens: int) -> int:
    """Return how many bands a prompt of this size exceeds (0: the base prices)."""
    n = 0
    for above, _prices in pricing.bands:
        if prompt_tokens > above:
            n += 1
        else:
            break
    return n


def _int_units(pricing: ModelPricing, prompt_tokens: int, tier: str, zone: str
               ) -> tuple[int, ...] | None:
    key = (id(pricing), _band(pricing, prompt_tokens), tier, zone)
    hit = _units.get(key)
    if hit is None or hit[0] is not pricing:
        if len(_units) > 10_000:
            _units.clear()
        hit = _units[key] = (pricing, units_in_last_places(
            class_units(pricing, prompt_tokens, tier, zone)))
    return hit[1]


def worst_case_micro(pricing: ModelPricing | None, *, tier: str, zone: str, prompt_tokens: int,
                     max_output: int) -> int:
    """Return the worst-case cost of a request in micro-units (no cache hit).

    Priced at the dearest band the prompt can reach: a band applies when the prompt exceeds
    its threshold, and the prompt has at most ``prompt_tokens``, so a band at or above that
    bound can never apply (pricing every request at the top band made a hard budget stop far
    short of its limit).
    """
    if pricing is None:
        return 0
    key = (id(pricing), _band(pricing, prompt_tokens), tier, zone)
    hit = _worst.get(key)
    if hit is None or hit[0] is not pricing:
        if len(_worst) > 10_000:
            _worst.clear()
        p_in, p_out = _dearest(pricing, prompt_tokens, tier, zone)
        # whole numbers of 1e-10 micro-units per token: the cost is then an exact integer sum
        scaled = (p_in.scaleb(10), p_out.scaleb(10))
        hit = _worst[key] = (pricing, (int(scaled[0]), int(scaled[1])) if all(
            v == v.to_integral_value() for v in scaled) else None)
    if hit[1] is not None:
        u_in, u_out = hit[1]
        return -(-(prompt_tokens * u_in + max_output * u_out) // 10**10)
    p_in, p_out = _dearest(pricing, prompt_tokens, tier, zone)
    return int((prompt_tokens * p_in + max_output * p_out)
               .to_integral_value(rounding=ROUND_CEILING))


def _dearest(pricing: ModelPricing, prompt_tokens: int, tier: str, zone: str
             ) -> tuple[Decimal, Decimal]:
    """Return the dearest input and output prices per 1M tokens a prompt of at most this size
    can meet, times the tier and zone multipliers (= micro-units per token)."""
    sets = [pricing.base, *[p for above, p in pricing.bands if prompt_tokens > above]]
    p_in = max(max(s.input, s.cached_input, s.cache_write) for s in sets)
    p_out = max(s.output for s in sets)
    mult = pricing.multiplier(tier, zone)
    return p_in * mult, p_out * mult


def actual_micro(pricing: ModelPricing | None, *, tier: str, zone: str, prompt_tokens: int,
                 cached_tokens: int, completion_tokens: int) -> int:
    """Return what rating will charge for these counts, in micro-units rounded up."""
    if pricing is None or prompt_tokens + completion_tokens == 0:
        return 0
    units = _int_units(pricing, prompt_tokens, tier, zone)
    if units is not None:
        # each line is n x unit exactly (nothing to round at 10 places), in units of 1e-10
        u_in, u_cached, u_out, _u_write = units
        total = ((prompt_tokens - cached_tokens) * u_in + cached_tokens * u_cached
                 + completion_tokens * u_out)
        return -(-total // 10**4)
    counts = TokenCounts(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                         completion_tokens=completion_tokens, cache_write_tokens=0,
                         service_tier=tier, data_zone=zone)
    _lines, amount = rounded_lines(exact_lines(pricing, counts))
    return to_micro(amount)


def credits_micro(coefficients: tuple[Decimal, Decimal, Decimal], *, prompt_tokens: int,
                  cached_tokens: int, completion_tokens: int) -> int:
    """Return token-plan credits (micro-credits, rounded up) of these counts."""
    c_in, c_cached, c_out = coefficients
    exact = ((prompt_tokens - cached_tokens) * c_in + cached_tokens * c_cached
             + completion_tokens * c_out) * MICRO
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


# --- the decision ---------------------------------------------------------------------------

def _duration(ms: int) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``20ms``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def rate_headers(raw: Sequence[RedisValue]) -> dict[str, str]:
    """Return OpenAI's ``x-ratelimit-*`` headers of the limits, remaining and resets a script
    answers (-1: no such limit)."""
    lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok = map(int, raw)
    headers: dict[str, str] = {}
    if lim_req >= 0:
        headers["x-ratelimit-limit-requests"] = str(lim_req)
        headers["x-ratelimit-remaining-requests"] = str(rem_req)
        headers["x-ratelimit-reset-requests"] = _duration(reset_req)
    if lim_tok >= 0:
        headers["x-ratelimit-limit-tokens"] = str(lim_tok)
        headers["x-ratelimit-remaining-tokens"] = str(rem_tok)
        headers["x-ratelimit-reset-tokens"] = _duration(reset_tok)
    return headers


@dataclass(slots=True)
class Ticket:
    """An admitted request: what it holds, and how to settle it."""

    policy: QuotaPolicy
    request_id: str
    tier: str
    zone: str
    estimate_tokens: int
    estimate_norm: int
    capacity: str
    rate_state: Sequence[RedisValue]  # the script's limits, remaining and resets (6 values)
    month: str  # of the budget keys the admission named
    reservation: str = ""  # the member of the org's reservation ZSET ("" when none)
    admitted_ms: int = 0  # Redis's clock at admission
    settled: bool = False
    _headers: dict[str, str] | None = field(default=None, repr=False)
    # admitted from a lease (``lease.Lease``) and what it holds of it per budget: settled there
    lease: Lease | None = field(default=None, repr=False)
    held: tuple[int, ...] = ()

    @property
    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers at admission (and the capacity it was served
        from, unless on demand); built when first asked for."""
        if self._headers is None:
            self._headers = rate_headers(self.rate_state)
            if self.capacity != "on_demand":
                self._headers["x-tollgate-capacity"] = self.capacity
        return self._headers

    @property
    def budget_keys(self) -> list[str]:
        return self.policy.budget_keys(self.month)

    def settle_op(self, *, prompt_tokens: int, cached_tokens: int,
                  completion_tokens: int) -> Op:
        """Return the settlement's operation (``scripts.ADMIT_LUA``'s ``settle``)."""
        p = self.policy
        prov = p.provisioned if self.capacity == "provisioned" else None
        dyn = [self.admitted_ms, self.estimate_tokens - prompt_tokens - completion_tokens,
               *budget_amounts(p, tier=self.tier, zone=self.zone, prompt_tokens=prompt_tokens,
                               cached_tokens=cached_tokens, completion_tokens=completion_tokens)]
        if p.window is not None:
            dyn.append(credits_micro(p.window.coefficients, prompt_tokens=prompt_tokens,
                                     cached_tokens=cached_tokens,
                                     completion_tokens=completion_tokens))
        if prov is not None:
            dyn.append(self.estimate_norm - normalized_tokens(
                prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                completion_tokens=completion_tokens, cache_burndown=prov.cache_burndown,
                output_burndown=prov.output_burndown))
        return _settle_frame(p, self.month, prov is not None).op(
            bulk(self.reservation) + ints(dyn))


def budget_amounts(p: QuotaPolicy, *, tier: str, zone: str, prompt_tokens: int,
                   cached_tokens: int, completion_tokens: int, worst: bool = False
                   ) -> list[int]:
    """Return what these counts cost under each budget rule of ``p`` (micro-units of money, or
    micro-credits of a plan's), or with ``worst`` what a request with these bounds may cost."""
    rules = p.budgets
    if not rules:
        return []
    if worst:
        cost = worst_case_micro(p.pricing, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
                                max_output=completion_tokens)
    else:
        cost = actual_micro(p.pricing, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
                            cached_tokens=cached_tokens, completion_tokens=completion_tokens)
    if len(rules) == 1 and rules[0].coefficients is None:  # the common case: one money budget
        return [cost]
    return [cost if b.coefficients is None else credits_micro(
        b.coefficients, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_tokens=completion_tokens) for b in rules]


def admit_frame(p: QuotaPolicy, month: str, kind: str = "a") -> Frame:
    """Return the policy's admission frame for budget keys of ``month`` (cached on it); with
    ``kind`` "l" a lease's (one more request value: how many requests it wants)."""
    attr = "_admit_frame" if kind == "a" else "_lease_frame"
    hit: tuple[str, Frame] | None = p.__dict__.get(attr)
    if hit is not None and hit[0] == month:
        return hit[1]
    rate_keys, rate_argv = p.static_admit
    keys = [*rate_keys, *p.budget_keys(month)]
    static: list[Arg] = [RESERVATION_TTL_MS, len(p.rate_scopes), len(p.budgets),
                         int(p.provisioned is not None), int(p.window is not None), *rate_argv]
    for limit, seed, hard in p.budget_static:
        static += [limit, seed, hard]
    if p.window is not None:
        w = p.window
        keys.append(window_key(p.org_id, w.subscription_id))
        static += [to_micro(w.limit), w.window_ms, " ".join(f"{m} {v}" for m, v in w.seed)]
    if p.provisioned is not None:
        r = p.provisioned
        keys.append(prov_key(p.org_id, r.reservation_id))
        static += [r.tokens_per_minute, int(r.reject_overflow)]
    frame = Frame(kind, keys, static, 2 + (kind == "l") + len(p.budgets)
                  + int(p.window is not None) + int(p.provisioned is not None))
    p.__dict__[attr] = (month, frame)
    return frame


def _settle_frame(p: QuotaPolicy, month: str, prov: bool) -> Frame:
    """Return the policy's settlement frame (budget keys of ``month``; with the provisioned
    bucket or not), cached on it."""
    frames: dict[tuple[str, bool], Frame] = p.__dict__.setdefault("_settle_frames", {})
    frame = frames.get((month, prov))
    if frame is not None:
        return frame
    keys = [reservations_key(p.org_id), *p.budget_keys(month)]
    static: list[Arg] = [len(p.budgets), int(p.window is not None), len(p.tpm_scopes),
                         int(prov)]
    if p.window is not None:
        keys.append(window_key(p.org_id, p.window.subscription_id))
        static.append(p.window.window_ms)
    keys += [k for k, _tpm in p.tpm_scopes]
    static += [tpm for _k, tpm in p.tpm_scopes]
    if prov and p.provisioned is not None:
        keys.append(prov_key(p.org_id, p.provisioned.reservation_id))
        static.append(p.provisioned.tokens_per_minute)
    if len(frames) > 16:  # months and capacities seen by one cached policy: a few
        frames.clear()
    frame = frames[(month, prov)] = Frame("s", keys, static, 3 + len(p.budgets) + int(
        p.window is not None) + int(prov))
    return frame


SPEND_CODES = {"organization": "organization_spend_limit_exceeded",
               "project": "project_spend_limit_exceeded",
               "end_user": "end_user_spend_limit_exceeded"}


def admit_op(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
             prompt_tokens: int, max_output: int, month: str | None = None
             ) -> tuple[Op, str, int]:
    """Return (operation, month of its budget keys, normalized estimate) of one admission
    (``scripts.ADMIT_LUA``'s ``admit``)."""
    p = policy
    month = month or month_tag()
    dyn = [prompt_tokens + max_output, *budget_amounts(
        p, tier=tier, zone=zone, prompt_tokens=prompt_tokens, cached_tokens=0,
        completion_tokens=max_output, worst=True)]
    if p.window is not None:
        dyn.append(credits_micro(p.window.coefficients, prompt_tokens=prompt_tokens,
                                 cached_tokens=0, completion_tokens=max_output))
    norm = 0
    if p.provisioned is not None:
        norm = math.ceil(prompt_tokens + max_output * p.provisioned.output_burndown)
        dyn.append(norm)
    return admit_frame(p, month).op(bulk(request_id) + ints(dyn)), month, norm


def explain(policy: QuotaPolicy, reason: str, raw_headers: Sequence[RedisValue], retry_ms: int,
            *, estimate: int, now: datetime | None = None) -> QuotaExceeded:
    """Turn the script's rejection into OpenAI's 429 (message, code, headers)."""
    headers = rate_headers(raw_headers)
    if retry_ms < 0:  # spend limit reached by settled spend: nothing changes before next month
        now = now or datetime.now(tz=UTC)
        nxt = (datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=UTC))
        retry_ms = int((nxt - now).total_seconds() * 1000)
    headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
    headers["retry-after-ms"] = str(max(retry_ms, 0))
    if reason == "requests":
        msg = (f"Rate limit reached for requests per minute (RPM): Limit "
               f"{headers.get('x-ratelimit-limit-requests')}. Please try again in "
               f"{_duration(retry_ms)}.")
        return QuotaExceeded(msg, code="rate_limit_exceeded", headers=headers, reason="rpm")
    if reason in ("tokens", "too_large"):
        limit = headers.get("x-ratelimit-limit-tokens")
        if reason == "too_large":
            headers.pop("retry-after", None)
            headers.pop("retry-after-ms", None)
            msg = (f"Request too large for tokens per minute (TPM): Limit {limit}, Requested "
                   f"{estimate}. Reduce the prompt or max_tokens.")
        else:
            msg = (f"Rate limit reached for tokens per minute (TPM): Limit {limit}, Requested "
                   f"{estimate}. Please try again in {_duration(retry_ms)}.")
        return QuotaExceeded(msg, code="rate_limit_exceeded", headers=headers,
                             reason="tpm" if reason == "tokens" else "request_too_large")
    if reason.startswith("budget:"):
        rule = policy.budgets[int(reason.split(":")[1]) - 1]
        if rule.scope == "plan":
            return QuotaExceeded(
                f"Your token plan's credits for this period are used up (limit "
                f"{rule.limit.normalize():f} credits, this request may need more than is left)."
                f" Buy a credit pack or wait for the next period.",
                code="plan_quota_exhausted", headers=headers, reason="plan_credits")
        return spend_limit_error(rule, headers)
    if reason == "window" and policy.window is not None:
        return QuotaExceeded(
            f"Your token plan's credits for the rolling {policy.window.hours}-hour window are "
            f"used up (limit {policy.window.limit.normalize():f} credits, this request may need "
            f"more than is left). Please try again in {_duration(retry_ms)}.",
            code="plan_quota_exhausted", headers=headers, reason="plan_window")
    if reason == "provisioned":
        headers["x-tollgate-capacity"] = "provisioned"
        return QuotaExceeded("Your provisioned capacity is fully used and its overflow policy "
                             "rejects excess requests.", code="rate_limit_exceeded",
                             headers=headers, reason="provisioned")
    return QuotaExceeded("Quota exceeded.", code="rate_limit_exceeded", headers=headers)


def spend_limit_error(rule: BudgetRule, headers: dict[str, str]) -> QuotaExceeded:
    if rule.scope == "end_user":
        return QuotaExceeded(
            f"The end user {rule.end_user!r} (the request's 'user') reached its monthly "
            f"spend limit ({rule.limit.normalize():f}). Raise that end user's budget or wait "
            "for the next month.", code=SPEND_CODES[rule.scope], headers=headers,
            reason="end_user_budget")
    who = "organization" if rule.scope == "organization" else "project"
    return QuotaExceeded(
        f"You exceeded your {who}'s monthly spend limit ({rule.limit.normalize():f}). "
        f"Raise the budget in the console or wait for the next month.",
        code=SPEND_CODES[rule.scope], headers=headers, reason=f"{rule.scope}_budget")

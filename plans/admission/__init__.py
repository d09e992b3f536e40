"""Admission: ONE atomic Redis step per request that checks and reserves every quota together.

Rate limits (RPM/TPM per key, project, org), hard budgets (a worst-case reservation, settled
to the actual cost), a blocking token plan's period and rolling window, and provisioned
capacity are checked and taken by one Lua script, so gateway processes never race each other.
A busy key far from its limits takes a share of them in one such step (a lease) and its
requests are admitted from it in the gateway process.

The package, in the order a request meets it:

- ``policy``: what is enforced, as values (``QuotaPolicy`` and its rules, ``QuotaExceeded``),
  the Redis key names and the micro-units counters hold. No IO.
- ``loading``: the policy of a (key, model) read from PostgreSQL, and a key's limits.
- ``decision``: estimates, the scripts' arguments, ``Ticket``, headers and 429 texts. No IO.
- ``scripts``: all the Lua.
- ``lease``: a busy policy's share of its limits, held and handed out by the process.
- ``runtime``: the reloading policy cache, the batcher, and the async API the gateway calls
  (``apolicy``, ``aadmit``, ``asettle``, ``apeek_headers``).

``from plans import admission`` and ``admission.<name>`` give the public names of all of them.
"""

from plans.admission.decision import (
    SPEND_CODES,
    Ticket,
    actual_micro,
    admit_op,
    credits_micro,
    explain,
    prompt_token_bound,
    rate_headers,
    spend_limit_error,
    worst_case_micro,
)
from plans.admission.loading import limits_of, quota_policy_load
from plans.admission.policy import (
    DEFAULT_USAGE_TIER,
    MICRO,
    RESERVATION_TTL_MS,
    USAGE_TIERS,
    BudgetRule,
    EndUserLimits,
    ProvisionedRule,
    QuotaExceeded,
    QuotaPolicy,
    WindowRule,
    budget_key,
    end_user_digest,
    end_user_rule,
    from_micro,
    month_tag,
    prov_key,
    rate_key,
    reservations_key,
    rule_key,
    to_micro,
    window_key,
)
from plans.admission.runtime import (
    MAX_BATCH,
    POLICY_STALE_S,
    POLICY_TTL_S,
    Limits,
    aadmit,
    aclose_leases,
    alimits,
    apeek_headers,
    apolicy,
    asettle,
)
from plans.admission.scripts import ADMIT_LUA, PEEK_LUA, PRELUDE_LUA, PURGE_LUA, STEP_LUA

__all__ = [
    "ADMIT_LUA", "DEFAULT_USAGE_TIER", "MAX_BATCH", "MICRO", "PEEK_LUA", "POLICY_STALE_S",
    "POLICY_TTL_S", "PRELUDE_LUA", "PURGE_LUA", "RESERVATION_TTL_MS", "SPEND_CODES", "STEP_LUA",
    "USAGE_TIERS", "BudgetRule", "EndUserLimits", "Limits", "ProvisionedRule", "QuotaExceeded",
    "QuotaPolicy", "Ticket", "WindowRule", "aadmit", "aclose_leases", "actual_micro",
    "admit_op", "alimits",
    "apeek_headers", "apolicy", "asettle", "budget_key", "credits_micro", "end_user_digest",
    "end_user_rule",
    "explain", "from_micro", "limits_of", "month_tag", "prompt_token_bound", "prov_key",
    "quota_policy_load", "rate_headers", "rate_key", "reservations_key", "rule_key",
    "spend_limit_error", "to_micro", "window_key", "worst_case_micro",
]

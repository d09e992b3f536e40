"""The batcher's pre-packed commands are byte for byte what packing the whole command sends:
a policy's static part packed once, a request's values packed per request, joined under one
EVALSHA header (no Redis needed: this is the wire contract the script reads)."""

from __future__ import annotations

from decimal import Decimal

import hiredis

from plans import admission
from plans.admission.wire import evalsha, pack_op
from plans.pricing import ModelPricing, PriceSet


def _policy(org: int) -> admission.QuotaPolicy:
    prices = PriceSet(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"), Decimal("0.50"))
    pricing = ModelPricing(version_id=1, currency="USD", model="m", base=prices, bands=(),
                           tier={}, zone={})
    return admission.QuotaPolicy(
        org_id=org, project_id=org, key_id=org,
        rpm=((f"o{org}", 100), (f"k{org}", 10)), tpm=((f"k{org}", 5000),),
        budgets=(admission.BudgetRule(budget_id=7, scope="organization", limit=Decimal("5"),
                                      hard=True, spent_seed=Decimal("1.25"), suspended=False),),
        pricing=pricing, allowed_regions=None)


def _whole(sha: bytes, ops: list[tuple[str, list[str], list[str | int]]]) -> bytes:
    keys = [k for _kind, ks, _argv in ops for k in ks]
    argv: list[str | int] = [len(ops)]
    for kind, ks, a in ops:
        argv += [kind, len(ks), len(a), *a]
    command = ("EVALSHA", sha, len(keys), *keys, *argv)
    return hiredis.pack_command(command)  # type: ignore[arg-type]


def test_an_admission_and_its_settlement_are_packed_as_the_whole_command_would_be():
    # given a policy with rate limits and a hard budget, and a request id that is not ASCII
    policy = _policy(42)
    request_id = "req_é9"

    # when an admission and the settlement of its ticket are packed
    op, month, norm = admission.admit_op(policy, request_id=request_id, tier="default",
                                         zone="global", prompt_tokens=100, max_output=50,
                                         month="202612")
    ticket = admission.Ticket(policy, request_id, "default", "global", 150, norm, "on_demand",
                              [100, 99, 1000, 5000, 4850, 1800], month,
                              f"{request_id} tg:q:{{o42}}:bud:7:202612 100", 1765000000000)
    settle = ticket.settle_op(prompt_tokens=90, cached_tokens=10, completion_tokens=40)
    sha = b"0" * 40

    # then the batch is byte for byte the command packed whole, in the script's layout
    res, budget = "tg:q:{o42}:res", "tg:q:{o42}:bud:7:202612"
    rate = ["tg:q:{o42}:rl:o42", "tg:q:{o42}:rl:k42"]
    worst = admission.worst_case_micro(policy.pricing, tier="default", zone="global",
                                       prompt_tokens=100, max_output=50)
    cost = admission.actual_micro(policy.pricing, tier="default", zone="global",
                                  prompt_tokens=90, cached_tokens=10, completion_tokens=40)
    admit_argv: list[str | int] = [
        admission.RESERVATION_TTL_MS, 2, 1, 0, 0, 100, -1, 10, 5000,
        5_000_000, 1_250_000, 1, request_id, 150, worst]
    settle_argv: list[str | int] = [1, 0, 1, 0, 5000, ticket.reservation, 1765000000000,
                                    150 - 90 - 40, cost]
    assert evalsha(sha, [op, settle]) == _whole(sha, [
        ("a", [res, *rate, budget], admit_argv),
        ("s", [res, budget, "tg:q:{o42}:rl:k42"], settle_argv)])
    assert ticket.headers["x-ratelimit-remaining-requests"] == "99"


def test_an_operation_packed_whole_routes_by_its_first_key():
    op = pack_op("a", ["tg:q:{o1}:rl:o1", "tg:q:{o1}:res"], [1, "x"])
    assert op[0] == "tg:q:{o1}:rl:o1"
    assert evalsha(b"1" * 40, [op]) == _whole(
        b"1" * 40, [("a", ["tg:q:{o1}:rl:o1", "tg:q:{o1}:res"], [1, "x"])])

"""Router policies: residency is never violated, affinity is per tenant, load stays bounded."""

from __future__ import annotations

from collections import Counter

import pytest

from engine_adapter.router import Router
from engine_adapter.types import EngineInfo, ModelNotServed, NoCapacity

SYSTEM = "You are a careful assistant for the Acme knowledge base. " * 8
LONG = SYSTEM * 2  # 14 blocks: more than STAY_BLOCKS


def _engines(n: int, *, region: str = "us-east", model: str = "m") -> list[EngineInfo]:
    return [EngineInfo(engine_id=f"{region}-{i}", pool="p", model=model, region=region,
                       url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def test_residency_only_engines_in_allowed_regions_are_chosen():
    router = Router(_engines(2, region="us-east") + _engines(2, region="eu-west"))
    for i in range(50):
        d = router.choose(model="m", namespace="org", prompt=f"{i} {SYSTEM}",
                          allowed_regions={"eu-west"})
        assert d.engine.region == "eu-west"
        router.release(d.engine.engine_id)


def test_no_healthy_engine_in_zone_is_an_error_not_a_detour():
    us, eu = _engines(2, region="us-east"), _engines(1, region="eu-west")
    router = Router(us + eu)
    router.mark(eu[0].engine_id, healthy=False)
    with pytest.raises(NoCapacity, match="not sent anywhere else"):
        router.choose(model="m", namespace="org", prompt="hi", allowed_regions={"eu-west"})
    with pytest.raises(ModelNotServed):
        router.choose(model="other", namespace="org", prompt="hi")


def test_offered_with_no_engine_up_is_no_capacity_and_not_offered_is_not_served():
    # given small offered in us-east and eu-west, with only the US engine running
    us = _engines(1, region="us-east")
    router = Router()
    router.set_engines(us, offered={"m": {"us-east", "eu-west"}})
    assert router.models() == {"m"} and router.regions_of("m") == {"us-east", "eu-west"}
    # then EU traffic is a retryable no-capacity, never a detour to the US
    with pytest.raises(NoCapacity) as down:
        router.choose(model="m", namespace="org", prompt="hi", allowed_regions={"eu-west"})
    assert down.value.status == 503
    # and a region it is not offered in is "not served", in words that name no other region
    with pytest.raises(ModelNotServed) as missing:
        router.choose(model="m", namespace="org", prompt="hi", allowed_regions={"ap-south"})
    assert missing.value.status == 404 and "us-east" not in str(missing.value)
    # the engines' own models are offered even without the spec's map
    router.set_engines(_engines(1, region="eu-west", model="x"))
    assert router.regions_of("x") == {"eu-west"} and router.models() == {"x"}


def test_cache_aware_keeps_a_tenant_conversation_on_one_engine():
    router = Router(_engines(4))
    first = router.choose(model="m", namespace="org-a", prompt=SYSTEM + "question one")
    router.release(first.engine.engine_id)
    again = router.choose(model="m", namespace="org-a", prompt=SYSTEM + "question two")
    router.release(again.engine.engine_id)
    assert again.engine == first.engine
    assert again.matched_blocks >= len(SYSTEM) // 64


def test_cache_affinity_never_crosses_tenants():
    router = Router(_engines(4))
    a = router.choose(model="m", namespace="org-a", prompt=SYSTEM + "x")
    router.release(a.engine.engine_id)
    b = router.choose(model="m", namespace="org-b", prompt=SYSTEM + "x")
    assert b.matched_blocks == 0  # same text, other tenant: no shared prefix


def test_bounded_load_one_hot_prefix_cannot_take_the_whole_pool():
    # given 40 concurrent requests that all share one prefix (none released yet)
    router = Router(_engines(2), bound=1.5)
    chosen = [router.choose(model="m", namespace="org", prompt=SYSTEM + str(i)).engine.engine_id
              for i in range(40)]
    counts = Counter(chosen)
    # then both engines work, and neither exceeds the bound over the mean
    assert len(counts) == 2
    assert max(counts.values()) <= 1.5 * 20 + 1


def test_sequential_requests_of_many_tenants_spread_over_the_pool():
    router = Router(_engines(2))
    picks = Counter()
    for tenant in range(20):
        for turn in range(2):
            d = router.choose(model="m", namespace=f"t{tenant}", prompt=SYSTEM + f"{turn}")
            router.release(d.engine.engine_id)
            picks[d.engine.engine_id] += 1
    assert max(picks.values()) / (sum(picks.values()) / 2) <= 1.3


def test_least_load_and_round_robin():
    rr = Router(_engines(3), policy="round_robin")
    assert len({rr.choose(model="m", namespace="o", prompt="p").engine for _ in range(3)}) == 3
    ll = Router(_engines(2), policy="least_load")
    a = ll.choose(model="m", namespace="o", prompt="p").engine
    b = ll.choose(model="m", namespace="o", prompt="p").engine
    assert a != b
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(policy="random")


def test_a_new_conversation_moves_off_a_busy_engine_only_where_its_prefix_is_cached():
    # given a tenant whose system prompt both engines hold, the first of them given many more
    # requests lately (all finished: no in-flight bound applies)
    router = Router(_engines(3), rate_bound=1.1)
    first, second, third = (e.engine_id for e in _engines(3))
    for n in range(12):
        router.release(router.choose(model="m", namespace="org-big", prompt=LONG + f"q{n}",
                                     exclude={second, third}).engine.engine_id)
    router.release(router.choose(model="m", namespace="org-big", prompt=LONG + "first",
                                 exclude={first, third}).engine.engine_id)
    # and a small tenant whose one copy of its prompt is on the busy engine
    router.release(router.choose(model="m", namespace="org-small", prompt=LONG + "hello",
                                 exclude={second, third}).engine.engine_id)
    # when each starts a new conversation
    big = router.choose(model="m", namespace="org-big", prompt=LONG + "new question")
    small = router.choose(model="m", namespace="org-small", prompt=LONG + "new question")
    # then the large tenant's goes to the other engine holding its prompt (nothing lost), and
    # the small tenant's stays where its only copy is (moving would lose the whole prompt)
    assert big.engine.engine_id == second and big.matched_blocks >= len(LONG) // 64
    assert small.engine.engine_id == first


def test_a_short_conversation_is_not_moved_off_a_busy_engine_for_nothing():
    # given a short conversation (fewer blocks than STAY_BLOCKS) on an engine given many more
    # requests lately than the others
    router = Router(_engines(3), rate_bound=1.1)
    first = _engines(3)[0].engine_id
    for n in range(12):
        router.release(router.choose(model="m", namespace=f"org-{n}", prompt=SYSTEM,
                                     exclude={e.engine_id for e in _engines(3)[1:]}
                                     ).engine.engine_id)
    turn_1 = "<user>Where is my invoice for March? " * 6
    router.release(router.choose(model="m", namespace="org-short", prompt=turn_1,
                                 exclude={e.engine_id for e in _engines(3)[1:]}
                                 ).engine.engine_id)
    # when its next turn is routed
    again = router.choose(model="m", namespace="org-short", prompt=turn_1 + "<user>And April?")
    # then it stays where the conversation is cached: elsewhere it would match nothing
    assert again.engine.engine_id == first and again.matched_blocks == len(turn_1) // 64

"""Seed the default catalog: a USD price book, a token plan and a provisioned offering.

Idempotent: running it again changes nothing that is already there (it never edits a price
version that is in force; new prices go into a new version through the API or admin).
Prices are per 1M tokens, in line with public open-model API list prices (2025).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction

from plans import services
from plans.choices import CapPolicy, PlanKind, ReservationTerm
from plans.models import CreditPack, Plan, PriceBook, PriceVersion, ProvisionedOffering

CATALOG_FROM = datetime(2025, 1, 1, tzinfo=UTC)

# model -> per-1M prices (strings: never floats near money). cached_input omitted = 0.1 x input.
MODEL_PRICES: list[dict[str, Any]] = [
    {"model": "tollgate/tiny-llama", "input": "0.02", "output": "0.04"},
    # an embedding model: input only (OpenAI's text-embedding-3-small is 0.02)
    {"model": "tollgate/tiny-embed", "input": "0.01", "output": "0", "cached_input": "0.01"},
    {"model": "llama-3.1-8b-instruct", "input": "0.18", "output": "0.18"},
    {"model": "llama-3.3-70b-instruct", "input": "0.88", "output": "0.88",
     "cached_input": "0.44"},
    {"model": "qwen3-235b-a22b", "input": "0.20", "output": "0.60",
     # long prompts cost more, priced on the whole request (Qwen / Gemini style)
     "bands": [{"above_prompt_tokens": 131072, "input": "0.40", "output": "1.20"}]},
]

TOKEN_PLAN: dict[str, Any] = {
    "code": "builder-monthly",
    "name": "Builder (monthly token plan)",
    "kind": PlanKind.TOKEN_PLAN,
    "monthly_fee": "20.00",
    "credits_per_period": "60000000",
    "window_credits": "5000000",
    "window_hours": 5,
    "cap_policy": CapPolicy.OVERAGE,
    "description": "60M credits a month, at most 5M in any 5 hours; overage at on-demand "
                   "prices. One credit is about one 8B-model token.",
    # credits per token: small models cheap, a large model's output costs 3 credits
    "coefficients": [
        {"model": "tollgate/tiny-llama", "token_class": "input", "coefficient": "0.1"},
        {"model": "tollgate/tiny-llama", "token_class": "cached_input", "coefficient": "0.01"},
        {"model": "tollgate/tiny-llama", "token_class": "output", "coefficient": "0.2"},
        {"model": "tollgate/tiny-embed", "token_class": "input", "coefficient": "0.05"},
        {"model": "tollgate/tiny-embed", "token_class": "cached_input", "coefficient": "0.05"},
        {"model": "llama-3.1-8b-instruct", "token_class": "input", "coefficient": "1"},
        {"model": "llama-3.1-8b-instruct", "token_class": "cached_input", "coefficient": "0.1"},
        {"model": "llama-3.1-8b-instruct", "token_class": "output", "coefficient": "1"},
        {"model": "llama-3.3-70b-instruct", "token_class": "input", "coefficient": "5"},
        {"model": "llama-3.3-70b-instruct", "token_class": "cached_input",
         "coefficient": "2.5"},
        {"model": "llama-3.3-70b-instruct", "token_class": "output", "coefficient": "5"},
        {"model": "qwen3-235b-a22b", "token_class": "input", "coefficient": "1"},
        {"model": "qwen3-235b-a22b", "token_class": "cached_input", "coefficient": "0.1"},
        {"model": "qwen3-235b-a22b", "token_class": "output", "coefficient": "3"},
    ],
}
CREDIT_PACK: dict[str, Any] = {"code": "boost-10m", "name": "10M credit boost",
                               "credits": "10000000", "price": "4.00", "validity_days": 90}

OFFERING: dict[str, Any] = {
    "code": "llama-70b-us-east-ptu",
    "name": "Llama 3.3 70B provisioned unit (us-east)",
    "model": "llama-3.3-70b-instruct",
    "region": "us-east",
    "currency": "USD",
    "tokens_per_minute_per_unit": 20000,
    "cache_burndown": "0",
    "output_burndown": "4",
    "hourly_unit_price": "2.00",
    "monthly_unit_price": "1200.00",
    "min_units": 1,
}


class Command(BaseCommand):
    help = "Create the default price book, token plan and provisioned offering (idempotent)."

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        made = []
        book = PriceBook.objects.filter(code="usd-list").first()
        if book is None:
            book = services.price_book_create(code="usd-list", name="USD list prices",
                                              currency="USD", is_default=True)
            made.append("price book usd-list")
        if not PriceVersion.objects.filter(price_book=book).exists():
            services.price_version_create(price_book=book, effective_from=CATALOG_FROM,
                                          prices=MODEL_PRICES, note="launch prices",
                                          allow_backdate=True)
            made.append(f"{len(MODEL_PRICES)} model prices")
        plan = Plan.objects.filter(code=TOKEN_PLAN["code"]).first()
        if plan is None:
            plan = services.plan_create(**TOKEN_PLAN)
            made.append(f"plan {plan.code}")
        if not CreditPack.objects.filter(plan=plan, code=CREDIT_PACK["code"]).exists():
            services.credit_pack_create(plan=plan, **CREDIT_PACK)
            made.append(f"credit pack {CREDIT_PACK['code']}")
        if not Plan.objects.filter(code="on-demand").exists():
            services.plan_create(code="on-demand", name="On-demand (pay as you go)",
                                 kind=PlanKind.ON_DEMAND,
                                 description="The list price book, billed monthly in arrears.")
            made.append("plan on-demand")
        if not ProvisionedOffering.objects.filter(code=OFFERING["code"]).exists():
            services.provisioned_offering_create(**OFFERING)
            made.append(f"offering {OFFERING['code']}")
        self.stdout.write("catalog: " + (", ".join(made) if made else "already seeded")
                          + f" (terms: {', '.join(ReservationTerm.values)})")

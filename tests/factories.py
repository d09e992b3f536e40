"""factory_boy factories for the suite. Keys are made through the service (it owns hashing)."""

from __future__ import annotations

import factory

from billing_platform.accounts import services
from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import Membership, Organization, Project, User


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    password = factory.PostGenerationMethodCall("set_password", "correct horse battery")

    @classmethod
    def _after_postgeneration(cls, instance, create, results=None):
        if create:
            instance.save()


class OrganizationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Organization

    name = factory.Sequence(lambda n: f"Org {n}")
    slug = factory.Sequence(lambda n: f"org-{n}")
    billing_email = factory.LazyAttribute(lambda o: f"billing@{o.slug}.example.com")


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project

    organization = factory.SubFactory(OrganizationFactory)
    name = factory.Sequence(lambda n: f"Project {n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    organization = factory.SubFactory(OrganizationFactory)
    role = Role.OWNER


def make_key(project: Project | None = None, **kwargs) -> tuple:
    """Create an API key through the service; return ``(ApiKey, secret)``."""
    project = project or ProjectFactory()
    kwargs.setdefault("name", "test key")
    kwargs.setdefault("scopes", ["inference"])
    return services.api_key_create(project=project, **kwargs)


# --- plans: price books and plans (made through the services, which own the rules) ----------

import itertools  # noqa: E402 - appended section, imports kept with it
from datetime import UTC, datetime  # noqa: E402

_plan_codes = itertools.count(1)

PRICES_FROM = datetime(2025, 1, 1, tzinfo=UTC)


def make_price_book(*, currency: str = "USD", code: str | None = None, prices=None,
                    effective_from=PRICES_FROM, is_default: bool = True, **multipliers):
    """Create a price book with one version; ``prices`` are dicts of per-1M decimal strings.

    ``multipliers`` may hold ``tier_multipliers`` / ``zone_multipliers`` maps.
    """
    from plans import services as plan_services

    book = plan_services.price_book_create(
        code=code or f"book-{currency.lower()}-{next(_plan_codes)}",
        name=f"{currency} test prices", currency=currency, is_default=is_default)
    plan_services.price_version_create(
        price_book=book, effective_from=effective_from, allow_backdate=True,
        prices=prices if prices is not None else [
            {"model": "test-model", "input": "1.00", "output": "2.00"}],
        **multipliers)
    return book


def make_token_plan(**overrides):
    """Create a token plan (1000 credits/period, 300 per 5 h, overage) for ``test-model``."""
    from plans import services as plan_services

    fields = {
        "code": f"tp-{next(_plan_codes)}", "name": "Test token plan",
        "kind": "token_plan", "monthly_fee": "10.00", "credits_per_period": "1000",
        "window_credits": "300", "window_hours": 5, "cap_policy": "overage",
        "coefficients": [
            {"model": "test-model", "token_class": "input", "coefficient": "1"},
            {"model": "test-model", "token_class": "cached_input", "coefficient": "0.1"},
            {"model": "test-model", "token_class": "output", "coefficient": "3"},
        ],
    }
    fields.update(overrides)
    return plan_services.plan_create(**fields)


# --- invoicing: organizations billed from a given date, provisioned offerings ----------------

def make_billed_org(*, created_at=None, tax_rate="0", **kwargs):
    """Create an organization (with a project) that exists since ``created_at`` (UTC)."""
    from decimal import Decimal

    org = OrganizationFactory(created_at=created_at or datetime(2026, 10, 1, tzinfo=UTC),
                              tax_rate=Decimal(tax_rate), **kwargs)
    ProjectFactory(organization=org)
    return org


def make_offering(*, model: str, region: str = "us-east", monthly_unit_price: str = "100.00",
                  **overrides):
    """Create a provisioned offering of ``model`` in ``region``."""
    from plans import services as plan_services

    fields = {"code": f"po-{next(_plan_codes)}", "name": f"{model} units", "model": model,
              "region": region, "tokens_per_minute_per_unit": 100_000,
              "hourly_unit_price": "1.00", "monthly_unit_price": monthly_unit_price}
    fields.update(overrides)
    return plan_services.provisioned_offering_create(**fields)

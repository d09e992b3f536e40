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

"""Typed makers for the model fields the apps declare many times with the same precision.

``decimal_field_maker(max_digits=.., decimal_places=..)`` returns a function that builds that
``DecimalField`` with any other options. Django sees an ordinary ``DecimalField``; the type
checker sees ``Decimal`` on read, or ``Decimal | None`` where ``null=True`` (django-stubs infers
that only for a direct ``models.DecimalField(...)`` call, not through a helper).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal, Protocol, TypeAlias, overload

from django.db import models
from django.db.models.expressions import Combinable

DecimalInput: TypeAlias = Decimal | int | float | str | Combinable
DecimalColumn: TypeAlias = "models.DecimalField[DecimalInput, Decimal]"
NullableDecimalColumn: TypeAlias = "models.DecimalField[DecimalInput | None, Decimal | None]"


class DecimalFieldMaker(Protocol):
    @overload
    def __call__(self, *, null: Literal[True], **kwargs: Any) -> NullableDecimalColumn: ...
    @overload
    def __call__(self, *, null: Literal[False] = ..., **kwargs: Any) -> DecimalColumn: ...


def decimal_field_maker(*, max_digits: int, decimal_places: int) -> DecimalFieldMaker:
    def make(**kwargs: Any) -> models.DecimalField[Any, Any]:
        return models.DecimalField(max_digits=max_digits, decimal_places=decimal_places, **kwargs)

    return make

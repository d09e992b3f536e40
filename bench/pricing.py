"""What several benchmarks set up the same way (import after ``django.setup()``)."""

from __future__ import annotations


def price_model(model: str) -> None:
    """Price a bench model in the default USD book: the gateway serves nothing it cannot
    bill (an unpriced model is refused)."""
    from django.utils import timezone

    from plans import services as plan_services
    from plans.models import PriceBook

    book = (PriceBook.objects.filter(currency="USD", is_default=True).first()
            or plan_services.price_book_create(code=f"bench-{model}", name="Bench prices",
                                               currency="USD", is_default=True))
    plan_services.price_version_create(
        price_book=book, effective_from=timezone.now(), allow_backdate=True, note="bench",
        prices=[{"model": model, "input": "0.50", "output": "1.50"}])

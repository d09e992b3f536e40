"""localstripe, plus what the platform needs of Stripe that it lacks: the tests' Stripe stand-in.

localstripe speaks Stripe's API over HTTP; this wrapper adds, as Stripe documents them:

- Idempotent requests. localstripe ignores the ``Idempotency-Key`` header, and the platform's
  "never a double charge" rests on that header: a charge whose answer was lost (a network
  error, a worker killed before it recorded the result) is sent again with the same key, and
  Stripe answers with the first result instead of charging again. Per key (and API key), the
  first result of a request that ran (2xx, or 402 for a declined card) is saved and replayed
  with ``Idempotent-Replayed: true``; the same key with other parameters is a 400
  ``idempotency_error``; requests with one key run one at a time.
- PaymentIntents' ``amount_received`` (the amount once succeeded, else 0), which localstripe
  leaves out and the platform pays by.
- Refunds as Stripe checks and reports them: ``/v1/refunds`` exists in localstripe, but it
  refunds past the charge's amount and emits no event. Here a refund beyond what is left is a
  400 ``amount_too_large`` (``param: amount``), a fully refunded charge a 400
  ``charge_already_refunded``, a disputed one a 400 ``charge_disputed``; a refund's
  ``payment_intent`` is set also when it names the charge; and each refund emits
  ``refund.created`` and ``charge.refunded`` (the charge with its cumulative
  ``amount_refunded`` and ``refunded``).
- Disputes, which localstripe lacks: a charge of Stripe's test card 4000000000000259
  (``pm_card_createDispute``) succeeds and is disputed at once (``fraudulent``,
  ``needs_response``, ``charge.dispute.created``; the charge is ``disputed``).
  ``/v1/disputes`` (list, by ``charge`` or ``payment_intent``), ``/v1/disputes/{id}``
  (retrieve; update ``evidence``/``metadata``/``submit``) and ``/v1/disputes/{id}/close``
  behave as in Stripe's test mode: evidence whose ``uncategorized_text`` is
  ``winning_evidence`` wins the dispute, ``losing_evidence`` loses it, other evidence puts it
  ``under_review``; closing accepts the loss. Each change emits ``charge.dispute.updated``,
  and ``charge.dispute.closed`` once it is won or lost.
- SetupIntents and PaymentMethods as Stripe keeps them, where localstripe does not: a
  SetupIntent confirmed for a customer attaches its PaymentMethod to that customer (and emits
  ``setup_intent.succeeded`` and ``payment_method.attached``); a declined card leaves it
  ``requires_payment_method`` with its ``last_setup_error`` (402 ``card_declined``, the
  SetupIntent in the error, ``setup_intent.setup_failed``), not ``canceled``; confirming one
  that succeeded or was canceled is a 400 ``setup_intent_unexpected_state``. A customer's
  ``invoice_settings[default_payment_method]`` must be attached to that customer (400
  ``resource_missing`` otherwise). A card's ``brand`` follows its number (localstripe calls
  every card ``visa``), and ``pm_card_mastercard`` is Stripe's test Mastercard.

Events go out through localstripe's own webhooks (``POST /_config/webhooks/<id>`` with
``url``, ``secret``, ``events``), signed with Stripe's scheme (``Stripe-Signature:
t=...,v1=HMAC-SHA256``), and are listed at ``/v1/events`` as Stripe lists them.

    python tests/stripe_standin.py --port 8420 --from-scratch
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any

from aiohttp import web
from localstripe import resources, server
from localstripe.errors import UserError
from localstripe.webhooks import schedule_webhook

_saved: dict[tuple[str, str], tuple[str, int, bytes, str]] = {}
_locks: dict[tuple[str, str], asyncio.Lock] = {}


@web.middleware
async def idempotency_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.headers.get("Idempotency-Key")
    if request.method != "POST" or not key:
        return await handler(request)
    scope = (request.headers.get("Authorization", ""), key)
    body = await request.read()  # aiohttp keeps it for the handler
    fingerprint = hashlib.sha256(request.path.encode() + b"\0" + body).hexdigest()
    async with _locks.setdefault(scope, asyncio.Lock()):
        saved = _saved.get(scope)
        if saved is not None:
            if saved[0] != fingerprint:
                return web.json_response({"error": {
                    "type": "idempotency_error",
                    "message": "Keys for idempotent requests can only be used with the same "
                               "parameters they were first used with."}}, status=400)
            _, status, payload, content_type = saved
            return web.Response(status=status, body=payload, content_type=content_type,
                                headers={"Idempotent-Replayed": "true", "Idempotency-Key": key})
        response = await handler(request)
        if isinstance(getattr(response, "body", None), bytes) and (
                200 <= response.status < 300 or response.status == 402):
            _saved[scope] = (fingerprint, response.status, response.body,
                             response.content_type)
        return response


def _amount_received(intent: resources.PaymentIntent) -> int:
    return intent.amount if intent.status == "succeeded" else 0


def _emit(kind: str, obj: resources.StripeObject) -> None:
    schedule_webhook(resources.Event(kind, obj))


# --- refunds -------------------------------------------------------------------------------

def _money_text(minor: int, currency: str) -> str:
    return f"{minor / 100:.2f} {currency}"


def _refund_checks(charge: Any = None, payment_intent: Any = None, amount: Any = None,
                   **_: Any) -> None:
    """Refuse what Stripe refuses before refunding; malformed input is left to localstripe."""
    charge_obj = None
    if isinstance(charge, str):
        charge_obj = resources.store.get("charge:" + charge)
    elif isinstance(payment_intent, str):
        intent = resources.store.get("payment_intent:" + payment_intent)
        charge_obj = intent.latest_charge if intent is not None else None
    if charge_obj is None or charge_obj.status != "succeeded":
        return
    if _disputes_of(charge_obj.id, closed_won=False):
        raise UserError(400, f"Charge {charge_obj.id} has been charged back; cannot issue a "
                             "refund.", {"code": "charge_disputed", "charge": charge_obj.id})
    left = charge_obj.amount - charge_obj.amount_refunded
    if left <= 0:
        raise UserError(400, f"Charge {charge_obj.id} has already been refunded.",
                        {"code": "charge_already_refunded", "charge": charge_obj.id})
    wanted = resources.try_convert_to_int(amount)
    if isinstance(wanted, int) and wanted > left:
        raise UserError(
            400, f"Refund amount ({_money_text(wanted, charge_obj.currency)}) is greater than "
                 f"unrefunded amount on charge ({_money_text(left, charge_obj.currency)})",
            {"code": "amount_too_large", "param": "amount"})


def _refund_api_create(cls: type[resources.Refund], **data: Any) -> resources.Refund:
    _refund_checks(**data)
    refund = cls(**data)
    charge = resources.Charge._api_retrieve(refund.charge)
    refund.payment_intent = refund.payment_intent or charge.payment_intent
    _emit("refund.created", refund)
    _emit("charge.refunded", charge)
    return refund


# --- disputes ------------------------------------------------------------------------------

DISPUTE_CARD = "4000000000000259"  # Stripe's test card: the charge succeeds, then is disputed
EVIDENCE_FIELDS = (
    "access_activity_log", "billing_address", "cancellation_policy",
    "cancellation_policy_disclosure", "cancellation_rebuttal", "customer_communication",
    "customer_email_address", "customer_name", "customer_purchase_ip", "customer_signature",
    "duplicate_charge_documentation", "duplicate_charge_explanation", "duplicate_charge_id",
    "product_description", "receipt", "refund_policy", "refund_policy_disclosure",
    "refund_refusal_explanation", "service_date", "service_documentation", "shipping_address",
    "shipping_carrier", "shipping_date", "shipping_documentation", "shipping_tracking_number",
    "uncategorized_file", "uncategorized_text")
CLOSED = ("won", "lost", "warning_closed")


class Dispute(resources.StripeObject):
    """A dispute (chargeback) of one charge, for its full amount."""

    object = "dispute"
    _id_prefix = "dp_"

    def __init__(self, charge: resources.Charge, reason: str = "fraudulent") -> None:
        super().__init__()
        self.amount = charge.amount
        self.currency = charge.currency
        self.charge = charge.id
        self.payment_intent = charge.payment_intent
        self.reason = reason
        self.status = "needs_response"
        self.is_charge_refundable = False
        self.balance_transactions: list[Any] = []
        self.evidence: dict[str, Any] = dict.fromkeys(EVIDENCE_FIELDS)
        self.evidence_details = {"due_by": self.created + 7 * 86400, "has_evidence": False,
                                 "past_due": False, "submission_count": 0}
        self.metadata: dict[str, str] = {}

    @classmethod
    def _api_create(cls, **data: Any) -> Dispute:
        raise UserError(405, "Disputes are opened by the cardholder's bank, not through the "
                             "API.")

    @classmethod
    def _api_delete(cls, id: str) -> Any:
        raise UserError(405, "Method Not Allowed")

    @classmethod
    def _api_update(cls, id: str, evidence: Any = None, metadata: Any = None,
                    submit: Any = None, **kwargs: Any) -> Dispute:
        if kwargs:
            raise UserError(400, f"Received unknown parameter: {next(iter(kwargs))}",
                            {"param": next(iter(kwargs))})
        dispute = cls._api_retrieve(id)
        if evidence is not None and not isinstance(evidence, dict):
            raise UserError(400, "Invalid hash", {"param": "evidence"})
        unknown = sorted(set(evidence or {}) - set(EVIDENCE_FIELDS))
        if unknown:
            raise UserError(400, f"Received unknown parameter: evidence[{unknown[0]}]",
                            {"param": f"evidence[{unknown[0]}]"})
        if metadata is not None and not isinstance(metadata, dict):
            raise UserError(400, "Invalid hash", {"param": "metadata"})
        if dispute.status in CLOSED:
            raise UserError(400, f"This dispute is already closed ({dispute.status}).")
        dispute.evidence.update(evidence or {})
        dispute.metadata.update(metadata or {})
        if resources.try_convert_to_bool(submit) is not False and evidence:
            dispute.evidence_details["has_evidence"] = True
            dispute.evidence_details["submission_count"] += 1
            text = str(dispute.evidence.get("uncategorized_text") or "")
            dispute.status = ("won" if "winning_evidence" in text
                              else "lost" if "losing_evidence" in text else "under_review")
        _emit("charge.dispute.updated", dispute)
        if dispute.status in CLOSED:
            _emit("charge.dispute.closed", dispute)
        return dispute

    @classmethod
    def _api_close(cls, id: str, **kwargs: Any) -> Dispute:
        if kwargs:
            raise UserError(400, f"Received unknown parameter: {next(iter(kwargs))}")
        dispute = cls._api_retrieve(id)
        if dispute.status in CLOSED:
            raise UserError(400, f"This dispute is already closed ({dispute.status}).")
        dispute.status = "lost"
        _emit("charge.dispute.updated", dispute)
        _emit("charge.dispute.closed", dispute)
        return dispute

    @classmethod
    def _api_list_all(cls, url: str, charge: Any = None, payment_intent: Any = None,
                      limit: Any = None, starting_after: Any = None,
                      **kwargs: Any) -> resources.List:
        if kwargs:
            raise UserError(400, f"Received unknown parameter: {next(iter(kwargs))}")
        li = super()._api_list_all(url, limit=limit, starting_after=starting_after)
        li._list = [d for d in li._list
                    if (charge is None or d.charge == charge)
                    and (payment_intent is None or d.payment_intent == payment_intent)]
        li._list.sort(key=lambda d: d.created, reverse=True)
        return li


def _disputes_of(charge_id: str, *, closed_won: bool = True) -> list[Dispute]:
    return [obj for key, obj in resources.store.items()
            if key.startswith("dispute:") and obj.charge == charge_id
            and (closed_won or obj.status != "won")]


_trigger_payment = resources.Charge._trigger_payment


def _trigger_payment_then_dispute(self: resources.Charge, on_success: Any = None) -> None:
    """Pay as localstripe does; a charge of the dispute test card is then disputed."""
    def succeeded() -> None:
        if on_success:
            on_success()
        method = resources.PaymentMethod._api_retrieve(self.payment_method)
        if getattr(method, "_card_number", "") == DISPUTE_CARD:
            _emit("charge.dispute.created", Dispute(self))

    _trigger_payment(self, on_success=succeeded)


_canonical_test_article = resources.PaymentMethod._try_get_canonical_test_article.__func__


def _test_article(cls: type[resources.PaymentMethod], id: str) -> Any:
    if id == "pm_card_createDispute":
        return resources.PaymentMethod(type="card", card={
            "number": DISPUTE_CARD, "exp_month": "12", "exp_year": "2030", "cvc": "123"})
    if id == "pm_card_mastercard":
        return resources.PaymentMethod(type="card", card={
            "number": MASTERCARD, "exp_month": "8", "exp_year": "2031", "cvc": "123"})
    return _canonical_test_article(cls, id)


# --- setup intents and payment methods -------------------------------------------------------

MASTERCARD = "5555555555554444"  # Stripe's test Mastercard (pm_card_mastercard)


def _brand(number: str) -> str:
    """Return a card's brand from its number, as Stripe names it."""
    if number.startswith("4"):
        return "visa"
    if number[:2] in ("51", "52", "53", "54", "55") or 2221 <= int(number[:4]) <= 2720:
        return "mastercard"
    if number.startswith(("6011", "65")):
        return "discover"
    if number.startswith("35"):
        return "jcb"
    if number.startswith("36"):
        return "diners"
    return "unknown"


_payment_method_init = resources.PaymentMethod.__init__


def _payment_method_init_branded(self: resources.PaymentMethod, *args: Any,
                                 **kwargs: Any) -> None:
    _payment_method_init(self, *args, **kwargs)
    if self.type == "card":
        self.card["brand"] = _brand(self._card_number)


class CardDeclined(UserError):
    """A 402 ``card_error``, as Stripe answers a declined card (localstripe says
    ``invalid_request_error`` for every error)."""

    def __init__(self, contents: dict[str, Any]) -> None:
        super().__init__(402, contents["message"], contents)
        self.body["error"]["type"] = "card_error"


_setup_intent_init = resources.SetupIntent.__init__


def _setup_intent_init_full(self: resources.SetupIntent, *args: Any, **kwargs: Any) -> None:
    _setup_intent_init(self, *args, **kwargs)
    self.last_setup_error = None


def _setup_succeeded(intent: resources.SetupIntent, method: resources.PaymentMethod) -> None:
    """A SetupIntent that succeeded for a customer attaches its PaymentMethod to it."""
    if intent.customer and method.customer != intent.customer:
        method.customer = intent.customer
        _emit("payment_method.attached", method)
    _emit("setup_intent.succeeded", intent)


def _setup_intent_attach(self: resources.SetupIntent, pm: resources.PaymentMethod) -> None:
    """Confirm with ``pm``: declined (the intent wants another method), 3-D Secure, or set up."""
    if pm._attaching_is_declined():
        self.status = "requires_payment_method"
        self.payment_method = None
        self.next_action = None
        self.last_setup_error = {"code": "card_declined", "decline_code": "generic_decline",
                                 "message": "Your card was declined.", "type": "card_error",
                                 "payment_method": pm._export()}
        _emit("setup_intent.setup_failed", self)
        raise CardDeclined({**self.last_setup_error, "setup_intent": self._export()})
    self.payment_method = pm.id
    self.last_setup_error = None
    if pm._requires_authentication():
        self.status = "requires_action"
        self.next_action = {"type": "use_stripe_sdk",
                            "use_stripe_sdk": {"type": "three_d_secure_redirect",
                                               "stripe_js": ""}}
        return
    self.status = "succeeded"
    self.next_action = None
    _setup_succeeded(self, pm)


_CONFIRM = re.compile(r"^/v1/setup_intents/([^/]+)/confirm$")


@web.middleware
async def setup_intent_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse to confirm a SetupIntent that is done; finish one whose 3-D Secure passed."""
    match = _CONFIRM.match(request.path) if request.method == "POST" else None
    intent = resources.store.get("setup_intent:" + match.group(1)) if match else None
    if intent is None:
        return await handler(request)
    if intent.status in ("succeeded", "canceled"):
        raise UserError(400, "You cannot confirm this SetupIntent because it has a status of "
                             f"{intent.status}.", {"code": "setup_intent_unexpected_state",
                                                   "setup_intent": intent._export()})
    was = intent.status
    response = await handler(request)
    if was == "requires_action" and intent.status == "succeeded" and intent.payment_method:
        _setup_succeeded(intent, resources.PaymentMethod._api_retrieve(intent.payment_method))
    return response


_customer_update = resources.Customer._api_update.__func__


def _customer_update_checked(cls: type[resources.Customer], id: str,
                             **data: Any) -> resources.Customer:
    """Refuse a default payment method that is not attached to this customer, as Stripe does."""
    settings = data.get("invoice_settings")
    wanted = settings.get("default_payment_method") if isinstance(settings, dict) else None
    if isinstance(wanted, str) and wanted:
        cls._api_retrieve(id)  # 404 first for a customer that does not exist
        method = resources.store.get("payment_method:" + wanted)
        if method is None or method.customer != id:
            raise UserError(400, f"The customer does not have a payment method with the ID "
                                 f"{wanted}. The payment method must be attached to the "
                                 "customer.",
                            {"code": "resource_missing",
                             "param": "invoice_settings[default_payment_method]"})
    return _customer_update(cls, id, **data)


def install() -> None:
    """Patch localstripe and add the routes above to its app (before it starts)."""
    resources.PaymentIntent.amount_received = property(_amount_received)
    resources.Refund._api_create = classmethod(_refund_api_create)
    resources.Charge._trigger_payment = _trigger_payment_then_dispute
    resources.Charge.disputed = property(lambda self: bool(_disputes_of(self.id)))
    resources.PaymentMethod._try_get_canonical_test_article = classmethod(_test_article)
    resources.PaymentMethod.__init__ = _payment_method_init_branded
    resources.SetupIntent.__init__ = _setup_intent_init_full
    resources.SetupIntent._attach_pm = _setup_intent_attach
    resources.Customer._api_update = classmethod(_customer_update_checked)
    app = server.app
    app.middlewares.insert(0, idempotency_middleware)
    app.middlewares.append(setup_intent_middleware)  # inside localstripe's error handling
    app.router.add_route("POST", "/v1/disputes/{id}/close",
                         server.api_extra(Dispute._api_close, "/v1/disputes/{id}/close"))
    for method, url, route in (("GET", "/v1/disputes/{id}", server.api_retrieve),
                               ("POST", "/v1/disputes/{id}", server.api_update),
                               ("GET", "/v1/disputes", server.api_list_all)):
        app.router.add_route(method, url, route(Dispute, url))


if __name__ == "__main__":
    install()
    server.start()

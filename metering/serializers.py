"""Wire shapes of the metering API. Validation only: no business logic here."""

from __future__ import annotations

from rest_framework import serializers

from metering.choices import CapacitySource, EventStatus, ServiceTier
from metering.events import MAX_ID

MAX_BATCH = 10_000

# A field called ``data`` or ``errors`` is fine at runtime (DRF's metaclass takes declared
# fields off the class, so the serializer's .data/.errors properties stay), but the stubs see
# an attribute overriding those properties: hence the [assignment] ignores on those fields.


class ExternalUsageEventSerializer(serializers.Serializer):
    """One usage event reported by an engine outside the fleet. Tokens are the engine's."""

    id = serializers.CharField(max_length=MAX_ID, help_text="Your event id: the idempotency "
                               "key, in a namespace of your own. A second event with the same "
                               "id is a duplicate; a platform request id (req_...) is refused.")
    project = serializers.CharField(required=False, help_text="Project id (proj_...). Defaults "
                                    "to the calling key's project, or the key's project when "
                                    "api_key is given.")
    api_key = serializers.CharField(required=False, allow_null=True, default=None,
                                    help_text="API key id (key_...) to attribute usage to.")
    model = serializers.CharField(max_length=200)
    region = serializers.CharField(max_length=64, default="external")
    engine = serializers.CharField(max_length=200, default="", allow_blank=True)
    service_tier = serializers.ChoiceField(choices=ServiceTier.choices,
                                           default=ServiceTier.DEFAULT)
    capacity_source = serializers.ChoiceField(
        choices=[CapacitySource.ON_DEMAND, CapacitySource.PROVISIONED, CapacitySource.PLAN],
        default=CapacitySource.ON_DEMAND,
    )
    prompt_tokens = serializers.IntegerField(min_value=0, max_value=2**53)
    cached_tokens = serializers.IntegerField(min_value=0, max_value=2**53, default=0)
    completion_tokens = serializers.IntegerField(min_value=0, max_value=2**53)
    reasoning_tokens = serializers.IntegerField(
        min_value=0, max_value=2**53, default=0,
        help_text="Of completion_tokens, those the model spent reasoning (billed as output).")
    queue_ms = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                        allow_null=True, default=None)
    ttft_ms = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                       allow_null=True, default=None)
    total_ms = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                        allow_null=True, default=None)
    status = serializers.ChoiceField(choices=EventStatus.choices, default=EventStatus.OK)
    event_time = serializers.DateTimeField(required=False, help_text="When the request ended "
                                           "(ISO 8601 with offset); defaults to now.")
    batch_id = serializers.CharField(max_length=MAX_ID, required=False, allow_null=True,
                                     default=None)

    def validate(self, attrs: dict) -> dict:
        if attrs["cached_tokens"] > attrs["prompt_tokens"]:
            raise serializers.ValidationError(
                {"cached_tokens": "cached_tokens cannot exceed prompt_tokens."})
        if attrs["reasoning_tokens"] > attrs["completion_tokens"]:
            raise serializers.ValidationError(
                {"reasoning_tokens": "reasoning_tokens cannot exceed completion_tokens."})
        return attrs


class UsageEventBatchSerializer(serializers.Serializer):
    organization = serializers.CharField(required=False, help_text="Organization id (org_...). "
                                         "Needed with a session when you belong to several.")
    # items are validated one by one by the view, so one bad event does not reject the rest
    events = serializers.ListField(child=serializers.JSONField(), min_length=1,
                                   max_length=MAX_BATCH)


class UsageEventBatchDocSerializer(serializers.Serializer):
    """The documented request shape (the view validates each event on its own)."""

    organization = serializers.CharField(required=False)
    events = ExternalUsageEventSerializer(many=True, help_text=f"1 to {MAX_BATCH} events.")


class UsageEventOutcomeSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    id = serializers.CharField()
    status = serializers.ChoiceField(choices=["recorded", "duplicate"])


class UsageEventErrorSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    id = serializers.CharField(allow_null=True)
    code = serializers.CharField(help_text="invalid | beyond_retention | not_rated | id_conflict")
    errors = serializers.DictField(help_text="field -> messages")  # type: ignore[assignment]


class UsageEventBatchResultSerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.ingest_result")
    recorded = serializers.IntegerField()
    duplicates = serializers.IntegerField()
    rejected = serializers.IntegerField()
    data = UsageEventOutcomeSerializer(many=True)  # type: ignore[assignment]
    errors = UsageEventErrorSerializer(many=True)  # type: ignore[assignment]


class UsageQuerySerializer(serializers.Serializer):
    organization = serializers.CharField(required=False)
    start = serializers.CharField(required=False, help_text="Inclusive: a date (UTC midnight) "
                                  "or an ISO timestamp on the hour. Default: start of the month.")
    end = serializers.CharField(required=False, help_text="Exclusive, like start. Default: the "
                                "end of the current hour.")
    project = serializers.CharField(required=False, help_text="Comma-separated project ids.")
    key = serializers.CharField(required=False, help_text="Comma-separated API key ids.")
    model = serializers.CharField(required=False, help_text="Comma-separated model names.")
    service_tier = serializers.CharField(required=False, help_text="Comma-separated tiers.")
    region = serializers.CharField(required=False, help_text="Comma-separated regions.")
    status = serializers.CharField(required=False, help_text="Comma-separated outcomes: ok, "
                                   "engine_error, client_aborted (at most 31 days).")
    group_by = serializers.CharField(required=False, help_text="Comma-separated: day, hour, "
                                     "model, project, key, service_tier, capacity_source, region, "
                                     "user (the requests' `user`; at most 31 days).")


class UsageBucketSerializer(serializers.Serializer):
    day = serializers.DateField(required=False)
    hour = serializers.DateTimeField(required=False)
    model = serializers.CharField(required=False)
    project = serializers.CharField(required=False)
    key = serializers.CharField(required=False, allow_null=True)
    service_tier = serializers.CharField(required=False)
    capacity_source = serializers.CharField(required=False)
    region = serializers.CharField(required=False)
    user = serializers.CharField(required=False, allow_null=True,
                                 help_text="The requests' `user`; null: none named.")
    currency = serializers.CharField()
    requests = serializers.IntegerField()
    error_requests = serializers.IntegerField()
    aborted_requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    normalized_tokens = serializers.IntegerField()
    amount = serializers.DecimalField(max_digits=28, decimal_places=10)
    credits_consumed = serializers.DecimalField(max_digits=28, decimal_places=10)


class UsageSummarySerializer(serializers.Serializer):
    object = serializers.CharField(default="usage")
    organization = serializers.CharField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    group_by = serializers.ListField(child=serializers.CharField())
    data = UsageBucketSerializer(many=True)  # type: ignore[assignment]
    totals = UsageBucketSerializer(many=True, help_text="One entry per currency.")


# --- dead letters (staff) --------------------------------------------------------------------

MAX_RETRY_IDS = 1000  # letters per bulk retry: each is recorded on its own, in turn
DEAD_LETTER_STATUSES = ("unresolved", "resolved", "all")


class DeadLetterQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=DEAD_LETTER_STATUSES, default="unresolved",
                                     help_text="unresolved (waiting for a retry), resolved, all.")
    origin = serializers.CharField(required=False, max_length=32,
                                   help_text="Where it was dead-lettered: stream, spool, api, "
                                             "fallback.")
    organization = serializers.CharField(required=False, max_length=40,
                                         help_text="Organization id (org_...).")
    created_after = serializers.DateTimeField(required=False, help_text="Inclusive.")
    created_before = serializers.DateTimeField(required=False, help_text="Exclusive.")
    limit = serializers.IntegerField(min_value=1, max_value=100, default=50)
    after = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1,
                                     help_text="The last id of the previous page.")


class DeadLetterSerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.dead_letter")
    id = serializers.IntegerField()
    origin = serializers.CharField()
    error = serializers.CharField()
    payload = serializers.CharField(help_text="The event as it was appended (JSON).")
    organization = serializers.CharField(allow_null=True, help_text="Read from the payload "
                                         "(null when it is not readable).")
    request_id = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()
    resolved_at = serializers.DateTimeField(allow_null=True)


class DeadLetterPageSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = DeadLetterSerializer(many=True)  # type: ignore[assignment]
    has_more = serializers.BooleanField()
    last_id = serializers.IntegerField(allow_null=True, help_text="Pass as `after` for the "
                                       "next page.")


class DeadLetterRetrySerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.dead_letter_retry")
    id = serializers.IntegerField(source="letter_id")
    outcome = serializers.ChoiceField(
        choices=["recorded", "duplicate", "already_resolved", "failed"],
        help_text="recorded: the event is in now; duplicate: it was in already (nothing "
                  "changed); already_resolved: the letter was retried before; failed: refused "
                  "again (see error), still unresolved.")
    request_id = serializers.CharField(allow_null=True)
    error = serializers.CharField(allow_blank=True)


class DeadLetterBulkRetryRequestSerializer(serializers.Serializer):
    ids = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=2**63 - 1), required=False,
        min_length=1, max_length=MAX_RETRY_IDS, help_text="The letters to retry.")
    all_unresolved = serializers.BooleanField(
        default=False, help_text=f"Instead of ids: the oldest {MAX_RETRY_IDS} unresolved "
                                 "letters after `after`, narrowed by origin and organization; "
                                 "has_more says whether more follow last_id.")
    origin = serializers.CharField(required=False, max_length=32)
    organization = serializers.CharField(required=False, max_length=40)
    after = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1,
                                     help_text="The last_id of the previous call.")

    def validate(self, attrs: dict) -> dict:
        if bool(attrs.get("ids")) == attrs["all_unresolved"]:
            raise serializers.ValidationError("Give either ids or all_unresolved: true.")
        if attrs.get("ids") and attrs.keys() & {"origin", "organization", "after"}:
            raise serializers.ValidationError("origin, organization and after go with "
                                              "all_unresolved only.")
        return attrs


class DeadLetterBulkRetrySerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = DeadLetterRetrySerializer(many=True)  # type: ignore[assignment]
    has_more = serializers.BooleanField()
    last_id = serializers.IntegerField(allow_null=True, help_text="With all_unresolved: pass "
                                       "as `after` to go on.")

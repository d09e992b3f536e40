"""Split each hourly rollup's amount by token class (for invoice lines per token class).

Existing rollups are backfilled from their events' ``rating_breakdown`` in the same
migration, so every rollup keeps ``amount = input_amount + cached_input_amount +
output_amount``.
"""

from decimal import Decimal

from django.db import migrations, models

BACKFILL = """
UPDATE usage_rollup_hourly r
   SET input_amount = s.input_amount, cached_input_amount = s.cached_input_amount,
       output_amount = s.output_amount
  FROM (SELECT organization_id, project_id, api_key_id, model, region, service_tier,
               capacity_source, currency, date_trunc('hour', event_time, 'UTC') AS hour,
               COALESCE(SUM((rating_breakdown->>'input')::numeric), 0) AS input_amount,
               COALESCE(SUM((rating_breakdown->>'cached_input')::numeric), 0)
                   AS cached_input_amount,
               COALESCE(SUM((rating_breakdown->>'output')::numeric), 0) AS output_amount
          FROM usage_event
         GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9) s
 WHERE r.organization_id = s.organization_id AND r.project_id = s.project_id
   AND r.api_key_id IS NOT DISTINCT FROM s.api_key_id AND r.model = s.model
   AND r.region = s.region AND r.service_tier = s.service_tier
   AND r.capacity_source = s.capacity_source AND r.currency = s.currency AND r.hour = s.hour
"""


def _amount():
    return models.DecimalField(decimal_places=10, default=Decimal("0"), max_digits=28)


class Migration(migrations.Migration):

    dependencies = [
        ("metering", "0003_shared_tier_choices"),
    ]

    operations = [
        migrations.AddField("usagerolluphourly", "input_amount", _amount()),
        migrations.AddField("usagerolluphourly", "cached_input_amount", _amount()),
        migrations.AddField("usagerolluphourly", "output_amount", _amount()),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
    ]

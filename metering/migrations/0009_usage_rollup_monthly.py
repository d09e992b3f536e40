"""Monthly sums of the hourly rollups (``UsageRollupMonthly``), kept by the database.

Finance's accrued revenue sums every organization's open period: read off the hourly rollups
that is ~60 rows per organization and dimension a month (10,000 organizations: 600,000 rows,
over a second). Statement triggers on ``usage_rollup_hourly`` add each statement's change to
the month's row in the statement itself: INSERT (new rows, +), UPDATE (new rows minus old rows:
ingest's ``INSERT ... ON CONFLICT DO UPDATE`` fires it for the rows it updated, as it fires the
INSERT one for those it inserted), DELETE (old rows, -); a TRUNCATE empties the summary.
Changes that move no summed column (cost attribution adds GPU time to rollups) net to nothing
and write nothing. Each trigger upserts its keys in one order (month, then organization and
dimensions), one statement, so concurrent ingest transactions lock summary rows in the same
order, and the rows summed here lie month by month (accrued revenue reads one month of every
organization: 889 pages instead of 10,213 org by org, at 10,000 orgs). Writers are locked out
while the existing rollups are summed once here, so none is missed or counted twice.
"""

import django.db.models.deletion
from decimal import Decimal
from django.db import migrations, models

KEY = "organization_id, month, model, region, service_tier, capacity_source, currency"
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "input_amount",
        "cached_input_amount", "output_amount")
_COLUMNS = ("organization_id, hour, model, region, service_tier, capacity_source, currency, "
            + ", ".join(SUMS))
_NONZERO = " OR ".join(f"SUM(d.sign * d.{c}) <> 0" for c in SUMS)
# Signed rollup rows ``d`` (sign, then _COLUMNS) summed into their months, in key order.
_UPSERT = f"""
INSERT INTO usage_rollup_monthly ({KEY}, rollups, {", ".join(SUMS)})
SELECT d.organization_id, date_trunc('month', d.hour, 'UTC'), d.model, d.region,
       d.service_tier, d.capacity_source, d.currency, SUM(d.sign),
       {", ".join(f"SUM(d.sign * d.{c})" for c in SUMS)}
  FROM ({{source}}) d
 GROUP BY 1, 2, 3, 4, 5, 6, 7
HAVING SUM(d.sign) <> 0 OR {_NONZERO}
 ORDER BY 2, 1, 3, 4, 5, 6, 7
ON CONFLICT ON CONSTRAINT usage_rollup_monthly_key DO UPDATE SET
    rollups = usage_rollup_monthly.rollups + EXCLUDED.rollups,
    {", ".join(f"{c} = usage_rollup_monthly.{c} + EXCLUDED.{c}" for c in SUMS)}
"""
_NEW = f"SELECT 1 AS sign, {_COLUMNS} FROM new_rows"
_OLD = f"SELECT -1 AS sign, {_COLUMNS} FROM old_rows"


def _function(name: str, source: str) -> str:
    return f"""
CREATE FUNCTION {name}() RETURNS trigger AS $$
BEGIN
    {_UPSERT.format(source=source)};
    RETURN NULL;
END $$ LANGUAGE plpgsql;
"""


SQL = f"""
LOCK TABLE usage_rollup_hourly IN SHARE ROW EXCLUSIVE MODE;
{_function("usage_rollup_monthly_inserted", _NEW)}
{_function("usage_rollup_monthly_updated", f"{_NEW} UNION ALL {_OLD}")}
{_function("usage_rollup_monthly_deleted", _OLD)}
CREATE FUNCTION usage_rollup_monthly_truncated() RETURNS trigger AS $$
BEGIN
    -- not TRUNCATE: a TRUNCATE of both tables (a test database's flush) holds this one
    DELETE FROM usage_rollup_monthly;
    RETURN NULL;
END $$ LANGUAGE plpgsql;

CREATE TRIGGER usage_rollup_monthly_insert AFTER INSERT ON usage_rollup_hourly
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_monthly_inserted();
CREATE TRIGGER usage_rollup_monthly_update AFTER UPDATE ON usage_rollup_hourly
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_monthly_updated();
CREATE TRIGGER usage_rollup_monthly_delete AFTER DELETE ON usage_rollup_hourly
REFERENCING OLD TABLE AS old_rows
FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_monthly_deleted();
CREATE TRIGGER usage_rollup_monthly_truncate AFTER TRUNCATE ON usage_rollup_hourly
FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_monthly_truncated();

SET LOCAL work_mem = '256MB';
{_UPSERT.format(source=f"SELECT 1 AS sign, {_COLUMNS} FROM usage_rollup_hourly")};
ANALYZE usage_rollup_monthly;
"""

REVERSE = """
DROP TRIGGER IF EXISTS usage_rollup_monthly_insert ON usage_rollup_hourly;
DROP TRIGGER IF EXISTS usage_rollup_monthly_update ON usage_rollup_hourly;
DROP TRIGGER IF EXISTS usage_rollup_monthly_delete ON usage_rollup_hourly;
DROP TRIGGER IF EXISTS usage_rollup_monthly_truncate ON usage_rollup_hourly;
DROP FUNCTION IF EXISTS usage_rollup_monthly_inserted();
DROP FUNCTION IF EXISTS usage_rollup_monthly_updated();
DROP FUNCTION IF EXISTS usage_rollup_monthly_deleted();
DROP FUNCTION IF EXISTS usage_rollup_monthly_truncated();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0003_organization_billing_profile'),
        ('metering', '0008_cost_to_serve_and_reconciliation'),
    ]

    operations = [
        migrations.CreateModel(
            name='UsageRollupMonthly',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('month', models.DateTimeField(help_text='Start of the UTC calendar month.')),
                ('model', models.CharField(max_length=200)),
                ('region', models.CharField(max_length=64)),
                ('service_tier', models.CharField(choices=[('default', 'Default (standard)'), ('priority', 'Priority'), ('flex', 'Flex'), ('batch', 'Batch')], max_length=16)),
                ('capacity_source', models.CharField(choices=[('on_demand', 'On-demand'), ('provisioned', 'Provisioned'), ('spillover', 'Spillover from provisioned'), ('plan', 'Token plan'), ('overage', 'Token plan overage')], max_length=16)),
                ('currency', models.CharField(max_length=3)),
                ('rollups', models.BigIntegerField(default=0)),
                ('requests', models.BigIntegerField(default=0)),
                ('prompt_tokens', models.BigIntegerField(default=0)),
                ('cached_tokens', models.BigIntegerField(default=0)),
                ('completion_tokens', models.BigIntegerField(default=0)),
                ('input_amount', models.DecimalField(decimal_places=10, default=Decimal('0'), max_digits=32)),
                ('cached_input_amount', models.DecimalField(decimal_places=10, default=Decimal('0'), max_digits=32)),
                ('output_amount', models.DecimalField(decimal_places=10, default=Decimal('0'), max_digits=32)),
                ('organization', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='accounts.organization')),
            ],
            options={
                'db_table': 'usage_rollup_monthly',
                'indexes': [models.Index(fields=['month'], name='usage_rollup_monthly_month')],
                'constraints': [models.UniqueConstraint(fields=('organization', 'month', 'model', 'region', 'service_tier', 'capacity_source', 'currency'), name='usage_rollup_monthly_key')],
            },
        ),
        migrations.RunSQL(SQL, REVERSE),
    ]

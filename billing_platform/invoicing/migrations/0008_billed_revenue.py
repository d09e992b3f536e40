"""Billed revenue summed across organizations (``BilledRevenue``), kept by the database.

An AFTER UPDATE statement trigger on invoices sums the lines of the invoices the statement
moved into the billed statuses (``open``, ``paid``, ``uncollectible``: finalize, a credit note
issued) or out of them (a void), signed, into summary rows: one insert per statement, however
many invoices it finalized (period close finalizes a chunk in one UPDATE), in the same
transaction. Lines are only inserted while their invoice is a draft, and a finalized invoice's
lines, kind, currency and period never change and it is never deleted (0002's and 0005's
triggers), so updates are the only way in or out and the rows cannot drift. Existing billed
invoices are summed once here.
"""

from django.db import migrations, models

BILLED = "('open', 'paid', 'uncollectible')"
# Summary rows of the invoices ``c`` (id, period_start, currency, kind, sign), keyed as
# ``invoicing.reports.billed_lines`` groups the lines.
_INSERT = """
INSERT INTO invoicing_billedrevenue
    (period_start, currency, kind, capacity_source, plan_code, model, region, service_tier,
     token_class, lines, amount, tokens)
SELECT c.period_start, c.currency,
       CASE WHEN c.kind = 'credit_note' THEN 'credit_note' ELSE l.kind END,
       l.capacity_source,
       CASE WHEN l.kind = 'plan_fee' THEN COALESCE(l.details ->> 'plan', '') ELSE '' END,
       l.model, l.region, l.service_tier, l.token_class, SUM(c.sign), SUM(c.sign * l.amount),
       COALESCE(SUM(c.sign * l.quantity) FILTER (WHERE l.unit = 'tokens'), 0)
  FROM {source} c
  JOIN invoicing_invoiceline l ON l.invoice_id = c.id
 GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9
"""

SQL = f"""
CREATE FUNCTION invoicing_billed_revenue_record() RETURNS trigger AS $$
DECLARE
    ids bigint[];
    signs int[];
BEGIN
    SELECT array_agg(n.id), array_agg(CASE WHEN n.status IN {BILLED} THEN 1 ELSE -1 END)
      INTO ids, signs
      FROM new_rows n JOIN old_rows o ON o.id = n.id
     WHERE (n.status IN {BILLED}) <> (o.status IN {BILLED});
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    {_INSERT.format(source='''(
        SELECT i.id, i.period_start, i.currency, i.kind, v.sign
          FROM unnest(ids, signs) AS v(id, sign)
          JOIN invoicing_invoice i ON i.id = v.id)''')};
    RETURN NULL;
END $$ LANGUAGE plpgsql;

CREATE TRIGGER invoicing_billed_revenue
AFTER UPDATE ON invoicing_invoice
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION invoicing_billed_revenue_record();

{_INSERT.format(source=f'''(
    SELECT id, period_start, currency, kind, 1 AS sign FROM invoicing_invoice
     WHERE status IN {BILLED})''')};
"""

REVERSE = """
DROP TRIGGER IF EXISTS invoicing_billed_revenue ON invoicing_invoice;
DROP FUNCTION IF EXISTS invoicing_billed_revenue_record();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('invoicing', '0007_finance_report_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='BilledRevenue',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('period_start', models.DateTimeField()),
                ('currency', models.CharField(max_length=3)),
                ('kind', models.CharField(max_length=20)),
                ('capacity_source', models.CharField(max_length=16)),
                ('plan_code', models.TextField()),
                ('model', models.CharField(max_length=200)),
                ('region', models.CharField(max_length=64)),
                ('service_tier', models.CharField(max_length=16)),
                ('token_class', models.CharField(max_length=16)),
                ('lines', models.BigIntegerField()),
                ('amount', models.DecimalField(decimal_places=4, max_digits=24)),
                ('tokens', models.DecimalField(decimal_places=6, max_digits=30)),
            ],
            options={
                'indexes': [models.Index(fields=['period_start'], name='billed_revenue_period')],
            },
        ),
        migrations.RunSQL(SQL, REVERSE),
    ]

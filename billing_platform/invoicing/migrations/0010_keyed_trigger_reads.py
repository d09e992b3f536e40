"""The statement triggers of invoices and lines read other rows by key, never by a scan.

0008's billed-revenue trigger joined the invoices a statement finalized to the invoice table and
then to all lines, and 0009's line check joined the new lines to the invoice table; the planner
chose hash joins over sequential scans of both tables where their column statistics were missing
or old (a fresh database, a month's first close), so each period-close chunk read every invoice
and line the run had written before it: the cost of a chunk grew with the run, and a 30,000-org
close cost more per organization than a 3,000-org one (bench/invoice_run.py, auto_explain).

Now the billed-revenue trigger takes the invoices' period, currency and kind from its own
transition tables (they hold the updated rows), and both triggers reach the other table through
a LATERAL subquery per key (``OFFSET 0`` keeps it one: a parameterized index probe per invoice,
whatever the statistics say). Without statistics the planner guesses hundreds of lines per
invoice, and the estimated cost then passed ``jit_above_cost``: JIT compiled each chunk's trigger
statement, 15 to 900 ms a statement (21 s of a 66 s close of 30,000 orgs) for 7,500 rows that
take 15 ms to read. The functions run with ``jit = off``: a trigger's statement reads the rows
of the statement that fired it, never enough to pay for compiling.
What they compute, and the errors they raise, are unchanged.
"""

from django.db import migrations

BILLED = "('open', 'paid', 'uncollectible')"

SQL = f"""
CREATE OR REPLACE FUNCTION invoicing_billed_revenue_record() RETURNS trigger AS $$
BEGIN
    INSERT INTO invoicing_billedrevenue
        (period_start, currency, kind, capacity_source, plan_code, model, region,
         service_tier, token_class, lines, amount, tokens)
    SELECT c.period_start, c.currency,
           CASE WHEN c.kind = 'credit_note' THEN 'credit_note' ELSE l.kind END,
           l.capacity_source,
           CASE WHEN l.kind = 'plan_fee' THEN COALESCE(l.details ->> 'plan', '') ELSE '' END,
           l.model, l.region, l.service_tier, l.token_class, SUM(c.sign),
           SUM(c.sign * l.amount),
           COALESCE(SUM(c.sign * l.quantity) FILTER (WHERE l.unit = 'tokens'), 0)
      FROM (SELECT n.id, n.period_start, n.currency, n.kind,
                   CASE WHEN n.status IN {BILLED} THEN 1 ELSE -1 END AS sign
              FROM new_rows n JOIN old_rows o ON o.id = n.id
             WHERE (n.status IN {BILLED}) <> (o.status IN {BILLED})) c
     CROSS JOIN LATERAL (
            SELECT l.kind, l.capacity_source, l.details, l.model, l.region, l.service_tier,
                   l.token_class, l.amount, l.quantity, l.unit
              FROM invoicing_invoiceline l
             WHERE l.invoice_id = c.id
            OFFSET 0) l
     GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9;
    RETURN NULL;
END $$ LANGUAGE plpgsql SET jit = off;

CREATE OR REPLACE FUNCTION invoicing_lines_inserted_immutable() RETURNS trigger AS $$
DECLARE inv bigint;
BEGIN
    SELECT n.invoice_id INTO inv
      FROM (SELECT DISTINCT invoice_id FROM new_rows) n
     CROSS JOIN LATERAL (
            SELECT 1 FROM invoicing_invoice i
             WHERE i.id = n.invoice_id AND i.status <> 'draft'
            OFFSET 0) i
     LIMIT 1;
    IF inv IS NOT NULL THEN
        RAISE EXCEPTION 'invoice % is finalized: its lines never change', inv
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NULL;
END $$ LANGUAGE plpgsql SET jit = off;
"""

REVERSE = f"""
CREATE OR REPLACE FUNCTION invoicing_billed_revenue_record() RETURNS trigger AS $$
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
    INSERT INTO invoicing_billedrevenue
        (period_start, currency, kind, capacity_source, plan_code, model, region,
         service_tier, token_class, lines, amount, tokens)
    SELECT c.period_start, c.currency,
           CASE WHEN c.kind = 'credit_note' THEN 'credit_note' ELSE l.kind END,
           l.capacity_source,
           CASE WHEN l.kind = 'plan_fee' THEN COALESCE(l.details ->> 'plan', '') ELSE '' END,
           l.model, l.region, l.service_tier, l.token_class, SUM(c.sign),
           SUM(c.sign * l.amount),
           COALESCE(SUM(c.sign * l.quantity) FILTER (WHERE l.unit = 'tokens'), 0)
      FROM (SELECT i.id, i.period_start, i.currency, i.kind, v.sign
              FROM unnest(ids, signs) AS v(id, sign)
              JOIN invoicing_invoice i ON i.id = v.id) c
      JOIN invoicing_invoiceline l ON l.invoice_id = c.id
     GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9;
    RETURN NULL;
END $$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION invoicing_lines_inserted_immutable() RETURNS trigger AS $$
DECLARE inv bigint;
BEGIN
    SELECT n.invoice_id INTO inv
      FROM new_rows n JOIN invoicing_invoice i ON i.id = n.invoice_id
     WHERE i.status <> 'draft'
     LIMIT 1;
    IF inv IS NOT NULL THEN
        RAISE EXCEPTION 'invoice % is finalized: its lines never change', inv
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NULL;
END $$ LANGUAGE plpgsql;
"""


class Migration(migrations.Migration):
    dependencies = [("invoicing", "0009_line_insert_check_per_statement")]

    operations = [migrations.RunSQL(SQL, REVERSE)]

"""Check the lines an INSERT adds against their invoices once per statement, not per row.

0002's row trigger looked up the invoice of every line inserted (a plpgsql call and an index
probe each): period close inserts ~15 lines per invoice, 150,000 for 10,000 organizations, in
one COPY per chunk. An AFTER INSERT statement trigger reads the statement's new lines
(a transition table) joined to their invoices once, and refuses the statement, with 0002's
message and error code, if any of them is finalized. Updates and deletes keep the row
trigger (rare, and a transition table serves one event only).
"""

from django.db import migrations

SQL = """
CREATE FUNCTION invoicing_lines_inserted_immutable() RETURNS trigger AS $$
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

DROP TRIGGER invoicing_line_immutable ON invoicing_invoiceline;
CREATE TRIGGER invoicing_line_immutable
BEFORE UPDATE OR DELETE ON invoicing_invoiceline
FOR EACH ROW EXECUTE FUNCTION invoicing_line_immutable();
CREATE TRIGGER invoicing_line_insert_immutable
AFTER INSERT ON invoicing_invoiceline
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION invoicing_lines_inserted_immutable();
"""

REVERSE = """
DROP TRIGGER IF EXISTS invoicing_line_insert_immutable ON invoicing_invoiceline;
DROP FUNCTION IF EXISTS invoicing_lines_inserted_immutable();
DROP TRIGGER invoicing_line_immutable ON invoicing_invoiceline;
CREATE TRIGGER invoicing_line_immutable
BEFORE INSERT OR UPDATE OR DELETE ON invoicing_invoiceline
FOR EACH ROW EXECUTE FUNCTION invoicing_line_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("invoicing", "0008_billed_revenue")]

    operations = [migrations.RunSQL(SQL, REVERSE)]

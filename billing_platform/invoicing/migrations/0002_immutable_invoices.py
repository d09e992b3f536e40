"""Database triggers that keep finalized invoices immutable, whatever code touches them."""

from django.db import migrations

SQL = """
CREATE FUNCTION invoicing_line_immutable() RETURNS trigger AS $$
DECLARE st text;
BEGIN
    SELECT status INTO st FROM invoicing_invoice
     WHERE id = COALESCE(NEW.invoice_id, OLD.invoice_id);
    IF st IS NOT NULL AND st <> 'draft' THEN
        RAISE EXCEPTION 'invoice % is finalized: its lines never change',
            COALESCE(NEW.invoice_id, OLD.invoice_id) USING ERRCODE = 'P0001';
    END IF;
    RETURN COALESCE(NEW, OLD);
END $$ LANGUAGE plpgsql;

CREATE TRIGGER invoicing_line_immutable
BEFORE INSERT OR UPDATE OR DELETE ON invoicing_invoiceline
FOR EACH ROW EXECUTE FUNCTION invoicing_line_immutable();

CREATE FUNCTION invoicing_invoice_immutable() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.status <> 'draft' THEN
            RAISE EXCEPTION 'invoice % is finalized: it is never deleted', OLD.id
                USING ERRCODE = 'P0001';
        END IF;
        RETURN OLD;
    END IF;
    IF OLD.status <> 'draft' AND (
        NEW.organization_id, NEW.kind, NEW.number, NEW.currency, NEW.period_start,
        NEW.period_end, NEW.tax_rate, NEW.subtotal, NEW.tax, NEW.credits_applied, NEW.total,
        NEW.amount_due, NEW.corrects_id, NEW.finalized_at
    ) IS DISTINCT FROM (
        OLD.organization_id, OLD.kind, OLD.number, OLD.currency, OLD.period_start,
        OLD.period_end, OLD.tax_rate, OLD.subtotal, OLD.tax, OLD.credits_applied, OLD.total,
        OLD.amount_due, OLD.corrects_id, OLD.finalized_at
    ) THEN
        RAISE EXCEPTION 'invoice % is finalized: its amounts never change', OLD.id
            USING ERRCODE = 'P0001';
    END IF;
    IF OLD.status <> 'draft' AND NEW.status = 'draft' THEN
        RAISE EXCEPTION 'invoice % is finalized: it cannot become a draft again', OLD.id
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;

CREATE TRIGGER invoicing_invoice_immutable
BEFORE UPDATE OR DELETE ON invoicing_invoice
FOR EACH ROW EXECUTE FUNCTION invoicing_invoice_immutable();
"""

REVERSE = """
DROP TRIGGER IF EXISTS invoicing_invoice_immutable ON invoicing_invoice;
DROP FUNCTION IF EXISTS invoicing_invoice_immutable();
DROP TRIGGER IF EXISTS invoicing_line_immutable ON invoicing_invoiceline;
DROP FUNCTION IF EXISTS invoicing_line_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("invoicing", "0001_initial")]

    operations = [migrations.RunSQL(SQL, REVERSE)]

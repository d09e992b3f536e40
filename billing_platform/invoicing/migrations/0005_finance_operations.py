"""Finance operations: dunning held, write-off, offline payment reference, credit notes' outcome
and line credits, one-off items for the next invoice, refunds; and a finalized invoice's
``amount_due`` may now fall (never rise, never below zero): a credit note on an unpaid invoice
reduces what is owed, as Stripe's pre-payment credit notes do. Every other money column of a
finalized invoice still never changes (trigger of 0002, replaced here)."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


# 0002's function, with amount_due moved out of the frozen columns into a rule of its own.
def _function(amount_due_may_fall: bool) -> str:
    frozen = ("NEW.organization_id, NEW.kind, NEW.number, NEW.currency, NEW.period_start, "
              "NEW.period_end, NEW.tax_rate, NEW.subtotal, NEW.tax, NEW.credits_applied, "
              "NEW.total, {due}NEW.corrects_id, NEW.finalized_at")
    due = "" if amount_due_may_fall else "NEW.amount_due, "
    new, old = frozen.format(due=due), frozen.format(due=due).replace("NEW.", "OLD.")
    falls = """
    IF OLD.status <> 'draft' AND (NEW.amount_due > OLD.amount_due OR NEW.amount_due < 0) THEN
        RAISE EXCEPTION 'invoice % is finalized: its amount due only falls, to zero at most',
            OLD.id USING ERRCODE = 'P0001';
    END IF;""" if amount_due_may_fall else ""
    return f"""
CREATE OR REPLACE FUNCTION invoicing_invoice_immutable() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.status <> 'draft' THEN
            RAISE EXCEPTION 'invoice % is finalized: it is never deleted', OLD.id
                USING ERRCODE = 'P0001';
        END IF;
        RETURN OLD;
    END IF;
    IF OLD.status <> 'draft' AND ({new}) IS DISTINCT FROM ({old}) THEN
        RAISE EXCEPTION 'invoice % is finalized: its amounts never change', OLD.id
            USING ERRCODE = 'P0001';
    END IF;{falls}
    IF OLD.status <> 'draft' AND NEW.status = 'draft' THEN
        RAISE EXCEPTION 'invoice % is finalized: it cannot become a draft again', OLD.id
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
"""


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0002_organization_resource_limits'),
        ('invoicing', '0004_webhook_review'),
    ]

    operations = [
        migrations.AddField(
            model_name='invoice',
            name='credit_outcome',
            field=models.CharField(blank=True, choices=[('amount_due', 'Reduced the amount due'), ('refund', 'Refunded through Stripe'), ('credit_balance', 'Credit balance')], default='', help_text='For a credit note: what its amount did.', max_length=16),
        ),
        migrations.AddField(
            model_name='invoice',
            name='dunning_paused_at',
            field=models.DateTimeField(blank=True, help_text='Set while finance holds dunning: no automatic retry.', null=True),
        ),
        migrations.AddField(
            model_name='invoice',
            name='payment_reference',
            field=models.CharField(blank=True, default='', help_text="A payment made outside Stripe: the bank transfer's reference.", max_length=200),
        ),
        migrations.AddField(
            model_name='invoice',
            name='written_off_at',
            field=models.DateTimeField(blank=True, help_text='When finance wrote it off as uncollectible.', null=True),
        ),
        migrations.AddField(
            model_name='invoiceline',
            name='corrects_line',
            field=models.ForeignKey(blank=True, help_text='On a credit note: the invoice line this line credits.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='credits', to='invoicing.invoiceline'),
        ),
        migrations.AlterField(
            model_name='invoiceline',
            name='kind',
            field=models.CharField(choices=[('usage', 'Usage'), ('late_usage', 'Late usage'), ('plan_fee', 'Plan fee'), ('reservation_fee', 'Reservation fee'), ('credit_pack', 'Credit pack'), ('tax', 'Tax'), ('credit', 'Credit applied'), ('adjustment', 'Adjustment'), ('one_off', 'One-off item')], max_length=20),
        ),
        migrations.CreateModel(
            name='PendingInvoiceItem',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('public_id', models.CharField(editable=False, max_length=40, unique=True)),
                ('description', models.CharField(max_length=300)),
                ('amount', models.DecimalField(decimal_places=4, max_digits=24)),
                ('currency', models.CharField(max_length=3)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('invoice', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='one_off_items', to='invoicing.invoice')),
                ('organization', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='pending_invoice_items', to='accounts.organization')),
            ],
            options={
                'ordering': ['created_at', 'id'],
                'indexes': [models.Index(condition=models.Q(('invoice__isnull', True)), fields=['organization'], name='pending_item_by_org')],
                'constraints': [models.CheckConstraint(condition=models.Q(('amount__gt', 0)), name='pending_item_positive')],
            },
        ),
        migrations.CreateModel(
            name='Refund',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('amount', models.DecimalField(decimal_places=4, max_digits=24)),
                ('currency', models.CharField(max_length=3)),
                ('idempotency_key', models.CharField(max_length=100, unique=True)),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('succeeded', 'Succeeded'), ('failed', 'Failed')], default='pending', max_length=16)),
                ('stripe_refund_id', models.CharField(blank=True, db_index=True, default='', max_length=100)),
                ('failure_message', models.CharField(blank=True, default='', max_length=500)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('credit_note', models.OneToOneField(on_delete=django.db.models.deletion.PROTECT, related_name='refund', to='invoicing.invoice')),
                ('invoice', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='refunds', to='invoicing.invoice')),
                ('payment', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='refunds', to='invoicing.paymentattempt')),
            ],
            options={
                'constraints': [models.CheckConstraint(condition=models.Q(('amount__gt', 0)), name='refund_positive')],
            },
        ),
        migrations.RunSQL(_function(amount_due_may_fall=True),
                          _function(amount_due_may_fall=False)),
    ]

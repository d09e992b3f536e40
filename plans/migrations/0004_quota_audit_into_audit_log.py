# The quota audit folds into the one audit log: its rows are copied, then its table goes.

from django.db import migrations


def copy_rows(apps, schema_editor):
    Quota = apps.get_model("plans", "QuotaAuditEvent")
    Audit = apps.get_model("audit", "AuditEvent")
    import secrets

    Audit.objects.bulk_create([
        Audit(public_id=f"aud_{secrets.token_hex(12)}", organization_id=r.organization_id,
              actor_user_id=r.actor_id, actor_label=r.actor.email if r.actor_id else "system",
              action=r.action, target=r.subject, after=r.details, created_at=r.created_at)
        for r in Quota.objects.select_related("actor").order_by("id").iterator()
    ], batch_size=1000)


class Migration(migrations.Migration):

    dependencies = [
        ('plans', '0003_quotas_budgets'),
        ('audit', '0001_initial'),
    ]

    operations = [
        migrations.RunPython(copy_rows, migrations.RunPython.noop),
        migrations.DeleteModel(
            name='QuotaAuditEvent',
        ),
    ]

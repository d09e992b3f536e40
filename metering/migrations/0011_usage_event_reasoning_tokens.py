from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('metering', '0010_usage_event_end_user'),
    ]

    # usage_event is partitioned by month: ADD COLUMN on the parent adds it to every
    # partition, and a constant default rewrites none of them (PostgreSQL 11+).
    operations = [
        migrations.AddField(
            model_name='usageevent',
            name='reasoning_tokens',
            field=models.PositiveBigIntegerField(default=0),
        ),
    ]

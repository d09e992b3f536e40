"""An index on usage_event_id.event_time: retention deletes the keys before its horizon in
batches (metering.retention). Built CONCURRENTLY: the table takes every event's key."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('metering', '0012_usage_event_end_user_index'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='usageeventid',
            index=models.Index(fields=['event_time'], name='usage_event_id_time'),
        ),
    ]

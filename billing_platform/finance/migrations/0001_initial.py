"""The permission-only model, its two permissions and the finance groups."""

from django.db import migrations, models

ANALYST = "Finance analyst"
CONTROLLER = "Finance controller"
GROUPS = {ANALYST: ["view_reports"], CONTROLLER: ["view_reports", "operate"]}


def create_groups(apps, schema_editor):
    # Permissions are normally created after all migrations (post_migrate); create them here
    # so the groups can hold them in the same migration run.
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    Group = apps.get_model("auth", "Group")
    content_type, _ = ContentType.objects.get_or_create(app_label="finance",
                                                        model="financeaccess")
    perms = {}
    for codename, name in (
            ("view_reports", "Read the finance reports of every organization"),
            ("operate", "Run finance operations (close, void, credit, write off, grant)")):
        perms[codename], _ = Permission.objects.get_or_create(
            content_type=content_type, codename=codename, defaults={"name": name})
    for group_name, codenames in GROUPS.items():
        group, _ = Group.objects.get_or_create(name=group_name)
        group.permissions.add(*(perms[c] for c in codenames))


def drop_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=GROUPS).delete()


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.CreateModel(
            name="FinanceAccess",
            fields=[("id", models.BigAutoField(auto_created=True, primary_key=True,
                                               serialize=False, verbose_name="ID"))],
            options={
                "managed": False,
                "default_permissions": (),
                "permissions": [
                    ("view_reports", "Read the finance reports of every organization"),
                    ("operate",
                     "Run finance operations (close, void, credit, write off, grant)"),
                ],
            },
        ),
        migrations.RunPython(create_groups, drop_groups),
    ]

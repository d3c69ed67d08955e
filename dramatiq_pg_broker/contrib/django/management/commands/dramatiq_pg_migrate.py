"""``python manage.py dramatiq_pg_migrate [--check] [--force]``: the broker's own migrations.

Why a command and not Django migrations: the broker's schema is versioned in its own
``schema_migrations`` table, which every worker and sender reads when it starts (the
schema handshake) and which ``dramatiq-pg-broker migrate`` writes. Django migrations
wrapping the same SQL files would record the same facts a second time, in
``django_migrations``, and the two records can disagree (a migration faked in one, a
database restored in the other, an upgrade run with the other tool): two sources of truth
for one schema. The command applies the same files as ``dramatiq-pg-broker migrate``,
with the broker's database and schema taken from the Django settings.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand

from .. import run_cli


class Command(BaseCommand):
    help = (
        "Create or upgrade the dramatiq_pg_broker tables in the broker's database and "
        "schema (as `dramatiq-pg-broker migrate`); safe to run again, or from several "
        "hosts at once."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--check",
            action="store_true",
            help="apply nothing: exit with status 1 when migrations are pending",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="apply a breaking migration even while processes that cannot check the "
            "schema show live work (leases, recent sends or claims)",
        )

    def handle(self, *args, check: bool = False, force: bool = False, **options):
        run_cli(["migrate"] + (["--check"] if check else []) + (["--force"] if force else []))

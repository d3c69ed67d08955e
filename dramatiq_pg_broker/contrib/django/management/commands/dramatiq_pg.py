"""``python manage.py dramatiq_pg <command> ...``: any ``dramatiq-pg-broker`` command
(``status``, ``jobs list``, ``queues pause``, ...) against the broker's database and
schema, as the Django settings configure them."""

from __future__ import annotations

import argparse

from django.core.management.base import BaseCommand

from .. import run_cli


class Command(BaseCommand):
    help = (
        "Run a dramatiq-pg-broker command (status, jobs, queues, workers ...) against the "
        "broker's database: `manage.py dramatiq_pg jobs list --status failed`."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "arguments", nargs=argparse.REMAINDER, help="the dramatiq-pg-broker command"
        )

    def handle(self, *args, arguments: list[str], **options):
        run_cli(arguments or ["--help"])

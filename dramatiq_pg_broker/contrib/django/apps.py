"""The Django app: ``"dramatiq_pg_broker.contrib.django"`` in ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig


class DramatiqPgBrokerConfig(AppConfig):
    """Brings the ``dramatiq_pg_migrate`` and ``dramatiq_pg`` management commands.

    The broker itself is built by django_dramatiq (its app config reads
    ``DRAMATIQ_BROKER`` when Django starts), and refuses a database it cannot serve right
    there; this app holds no models and no Django migrations: the broker's tables have
    their own (see the ``dramatiq_pg_migrate`` command for why).
    """

    name = "dramatiq_pg_broker.contrib.django"
    label = "dramatiq_pg_broker"
    verbose_name = "Dramatiq PostgreSQL broker"

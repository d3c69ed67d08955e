"""The Django integration: a Django app to add to ``INSTALLED_APPS`` next to
django_dramatiq, and the broker to name in ``DRAMATIQ_BROKER``::

    INSTALLED_APPS = ["django_dramatiq", "dramatiq_pg_broker.contrib.django", ...]
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq_pg_broker.contrib.django.PostgresBroker",
        "OPTIONS": {},  # no url: Django's "default" database
        "MIDDLEWARE": [...],
    }

Sends inside ``transaction.atomic()`` are written on Django's connection (see
:class:`~dramatiq_pg_broker.contrib.django.broker.PostgresBroker`); ``python manage.py
dramatiq_pg_migrate`` creates and upgrades the broker's tables, and ``python manage.py
dramatiq_pg ...`` runs any ``dramatiq-pg-broker`` command against the broker's database.
The guide: ``docs/guides/django.md``.
"""

from .broker import PostgresBroker

__all__ = ["PostgresBroker"]

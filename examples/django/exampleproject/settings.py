"""Settings of the example project: a shop whose orders and their receipt jobs commit
together.

The database comes from ``DATABASE_URL`` (a libpq URL or connection string; libpq's own
parameters, such as ``sslmode`` or ``options``, go into the database's OPTIONS). The broker
uses the same database: no URL of its own.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "exampleproject.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django_dramatiq",
    "dramatiq_pg_broker.contrib.django",
    "shop",
]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]


def database_from_url(url: str) -> dict:
    """A DATABASES entry for Django's PostgreSQL backend (psycopg 3) from a libpq URL."""
    params = conninfo_to_dict(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", ""),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
    }


DATABASES = {"default": database_from_url(os.environ.get("DATABASE_URL", "postgresql:///shop"))}

DRAMATIQ_BROKER = {
    "BROKER": "dramatiq_pg_broker.contrib.django.PostgresBroker",
    # No url: Django's "default" database. The schema is DRAMATIQ_PG_SCHEMA's, or
    # "dramatiq"; sends inside transaction.atomic() join it ("join_atomic": True).
    "OPTIONS": {},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Pipelines",
        # The broker's Retries: a retry reschedules the same row.
        "dramatiq_pg_broker.Retries",
        "dramatiq.middleware.CurrentMessage",
        # Closes the workers' stale Django connections around each job.
        "django_dramatiq.middleware.DbConnectionsMiddleware",
    ],
}

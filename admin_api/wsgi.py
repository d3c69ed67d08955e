"""The WSGI entry point for gunicorn: settings from the ``DRAMATIQ_PG_*`` variables."""

from admin_api import create_app

app = create_app()

"""The admin HTTP API of dramatiq-pg-broker: a Falcon app over the job tables.

Build it with :func:`create_app`; serve it with
``gunicorn -c python:admin_api.gunicorn_conf admin_api.wsgi:app``.
"""

from .app import create_app

__all__ = ["create_app"]

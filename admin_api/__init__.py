"""The admin HTTP API of dramatiq-pg-broker: a Falcon app over the job tables, and the
accounts (users, sessions, API tokens) it authenticates with. Installed with the ``admin``
extra (``pip install 'dramatiq-pg-broker[admin]'``); the broker never imports it.

Build it with :func:`create_app`; serve it with
``gunicorn -c python:admin_api.gunicorn_conf admin_api.wsgi:app``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # The app (and Falcon) load on first use, so that ``admin_api.cli`` stays light.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

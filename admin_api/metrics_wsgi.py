"""The WSGI entry point of the metrics-only app, for a separate bind without credentials::

    gunicorn --workers 1 --bind 10.0.0.5:9808 'admin_api.metrics_wsgi:app'

One worker: the counters are per process (see :mod:`admin_api.metrics`).
"""

from admin_api.resources.metrics import create_metrics_app

app = create_metrics_app()

"""gunicorn settings for the admin API::

    gunicorn -c python:admin_api.gunicorn_conf admin_api.wsgi:app

Each value can be overridden on the command line (``--bind``, ``--workers`` ...) or with
the environment variables below.

- ``ADMIN_API_BIND``: where to listen (default ``127.0.0.1:8000``; put a TLS proxy in
  front before listening on a public address).
- ``ADMIN_API_WORKERS``: processes (default 2: the API is light, and each process keeps
  its own database pools).
- ``ADMIN_API_THREADS``: threads per process (default 4): requests mostly wait on
  PostgreSQL, so threads serve them well; keep workers x threads within the database's
  connection budget (each process opens up to DRAMATIQ_PG_POOL_MAX_SIZE connections for
  reads and as many for changes).
"""

from __future__ import annotations

import os

bind = os.environ.get("ADMIN_API_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("ADMIN_API_WORKERS", "2"))
threads = int(os.environ.get("ADMIN_API_THREADS", "4"))
worker_class = "gthread"
# A request that takes longer than this is stuck (the API's queries take milliseconds);
# the worker is restarted.
timeout = 30
graceful_timeout = 20
keepalive = 5
# Each process opens its own pools after the fork; nothing is shared with the master.
preload_app = False
# Recycle workers now and then so that a slow leak can never grow unbounded.
max_requests = 10_000
max_requests_jitter = 1_000
accesslog = "-"
errorlog = "-"
loglevel = os.environ.get("ADMIN_API_LOG_LEVEL", "info")
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms "%(a)s"'
# Only trust X-Forwarded-* from a proxy on this host.
forwarded_allow_ips = "127.0.0.1"
proc_name = "dramatiq-pg-admin-api"

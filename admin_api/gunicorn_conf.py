"""gunicorn settings for the admin API::

    gunicorn -c python:admin_api.gunicorn_conf admin_api.wsgi:app

Each value can be overridden on the command line (``--bind``, ``--workers`` ...) or with
the environment variables below.

- ``ADMIN_API_BIND``: where to listen (default ``127.0.0.1:8000``; put a TLS proxy in
  front before listening on a public address).
- ``ADMIN_API_WORKERS``: processes (default 2: the API is light, and each process keeps
  its own database pools).
- ``ADMIN_API_THREADS``: threads per process (default 64; see below).
- ``ADMIN_API_CONTROL_SOCKET``: a path for gunicorn's control socket (gunicorn 25.1 and
  later, for its ``gunicornc`` tool); without it there is none (see below).

Slow and idle clients. gunicorn's threaded worker gives each connection that has sent
its first bytes a thread until the request is read, and waits up to 5 s in a thread for a
new connection's first bytes; a client that sends half a header and stops holds its
thread for as long as it keeps the connection open. With a handful of threads, ten such
clients froze the API. So each process runs 64 threads: a thread waiting on a socket
costs memory, not CPU, and the database connections stay bounded by the pools
(``DRAMATIQ_PG_POOL_MAX_SIZE`` per process for reads and as many for changes), not by the
threads. 50 slow or idle clients then leave threads free for ``/api/health`` and
everything else. Past about 60 such clients on one process they would block it again:
on any network you do not trust, put a buffering reverse proxy (nginx, HAProxy, a cloud
load balancer) in front, which reads each request whole, with its own header timeout,
before it reaches gunicorn (see the deployment guide in the docs).

Errors gunicorn answers itself, before the app (a request line over 4094 bytes: 414;
more than 100 header fields or one over 8190 bytes: 431; a malformed request: 400), are
JSON in the API's error shape, like every other error.
"""

from __future__ import annotations

import json
import os

import gunicorn.util

from admin_api.request_limits import REQUEST_FIELD_BYTES, REQUEST_FIELDS, REQUEST_LINE_BYTES

bind = os.environ.get("ADMIN_API_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("ADMIN_API_WORKERS", "2"))
threads = int(os.environ.get("ADMIN_API_THREADS", "64"))
worker_class = "gthread"
# A request that takes longer than this is stuck (the API's queries stop at the statement
# timeout, 5 s by default); the worker is restarted.
timeout = 30
graceful_timeout = 20
keepalive = 5
# Each process opens its own pools after the fork; nothing is shared with the master.
preload_app = False
# Recycle workers now and then so that a slow leak can never grow unbounded.
max_requests = 10_000
max_requests_jitter = 1_000
# gunicorn's own limits on the request head (its defaults, stated; the API's document
# declares them on every operation): a longer request line is a 414, more or longer header
# fields a 431.
limit_request_line = REQUEST_LINE_BYTES
limit_request_fields = REQUEST_FIELDS
limit_request_field_size = REQUEST_FIELD_BYTES
accesslog = "-"
errorlog = "-"
loglevel = os.environ.get("ADMIN_API_LOG_LEVEL", "info")
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms "%(a)s"'
# Only trust X-Forwarded-* from a proxy on this host.
forwarded_allow_ips = "127.0.0.1"
proc_name = "dramatiq-pg-admin-api"
# gunicorn 25.1 and later open a control socket for gunicornc, by default at
# $XDG_RUNTIME_DIR/gunicorn.ctl or $HOME/.gunicorn/gunicorn.ctl: outside the deployment,
# and one path for every gunicorn of the user, so that a second server takes it from the
# first. This configuration needs none: it is off unless ADMIN_API_CONTROL_SOCKET names a
# path of this server's own. Older gunicorn ignores both names (a configuration file's
# unknown names are skipped).
_control_socket = os.environ.get("ADMIN_API_CONTROL_SOCKET", "")
control_socket_disable = not _control_socket
if _control_socket:
    control_socket = _control_socket

#: The ``error`` code of each status gunicorn may answer by itself.
_CODES = {
    400: "bad_request",
    403: "forbidden",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    500: "internal_error",
    501: "not_implemented",
}
_MESSAGES = {
    414: f"The request line is longer than {limit_request_line} bytes: shorten the URL "
    "(fewer or shorter query parameters).",
    431: f"The request has more than {limit_request_fields} header fields or one longer "
    f"than {limit_request_field_size} bytes.",
}


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's error page, as the API's JSON error body instead of HTML."""
    message = _MESSAGES.get(status_int) or f"{reason}: {mesg}".strip()
    if not message.endswith("."):
        message += "."
    body = json.dumps(
        {"error": _CODES.get(status_int, "error"), "message": message}, ensure_ascii=True
    ).encode("ascii")
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        "Cache-Control: no-store\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")
    gunicorn.util.write_nonblock(sock, head + body)


# gunicorn's workers write these errors with gunicorn.util.write_error; this module is
# loaded by the master before it forks them.
gunicorn.util.write_error = write_json_error

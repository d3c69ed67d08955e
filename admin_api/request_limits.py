"""The limits on a request's head that the server (gunicorn, configured by
:mod:`admin_api.gunicorn_conf`) answers itself, before the app: a longer request line is a
414, more or longer header fields a 431. Here so that the server's configuration and the
API's document (:mod:`admin_api.openapi`) state the same numbers. gunicorn's own defaults,
stated."""

from __future__ import annotations

#: The longest request line (method, URL with its query string, protocol), in bytes.
REQUEST_LINE_BYTES = 4094
#: The most header fields in a request.
REQUEST_FIELDS = 100
#: The longest header field (name and value), in bytes.
REQUEST_FIELD_BYTES = 8190

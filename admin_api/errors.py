"""Errors as JSON, mapped to HTTP once.

Every error response has the same body::

    {"error": "not_found", "message": "No job has the id 4f0c...: check the id."}

``error`` is a stable code a script can branch on (the status's name in snake case);
``message`` is a sentence for a person. Domain errors of ``dramatiq_pg_broker`` are
translated here, with :meth:`falcon.App.add_error_handler`, not in each resource.
"""

from __future__ import annotations

import logging

import dramatiq.errors
import falcon
import psycopg
import psycopg_pool
import sqlalchemy.exc

from dramatiq_pg_broker.errors import (
    InvalidQueueLimit,
    InvalidQueueName,
    InvalidTransition,
    JobBusy,
    JobNotFound,
    QueueNotDeclared,
    SchemaMissing,
    SchemaVersionError,
    WorkflowNotFound,
)

from .accounts import (
    EmailTaken,
    HashingBusy,
    InvalidAccountData,
    LastAdmin,
    TokenNotFound,
    UserNotFound,
)

logger = logging.getLogger(__name__)

# Dramatiq 2.2 renamed ConnectionError (the old name still works, with a warning).
BrokerConnectionError = (
    getattr(dramatiq.errors, "BrokerConnectionError", None) or dramatiq.errors.ConnectionError
)

#: The ``error`` code of each status the API sends.
CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    411: "length_required",
    413: "payload_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    429: "too_many_requests",
    431: "request_header_fields_too_large",
    500: "internal_error",
    503: "unavailable",
}


class ApiError(falcon.HTTPError):
    """An HTTP error whose body is ``{"error": ..., "message": ...}``.

    Parameters:
      status(int): the HTTP status.
      message(str): what was wrong, as a sentence.
      headers(dict): extra response headers.
    """

    def __init__(self, status: int, message: str, *, headers: dict | None = None) -> None:
        super().__init__(
            status, title=CODES.get(status, "error"), description=message, headers=headers
        )


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def serialize_error(req: falcon.Request, resp: falcon.Response, error: falcon.HTTPError) -> None:
    """Write any :class:`falcon.HTTPError` (ours or Falcon's own, such as an unknown route or
    an invalid query parameter) in the API's error shape."""
    status = error.status_code
    message = error.description or error.title or "The request failed."
    if status == 404 and isinstance(error, falcon.HTTPRouteNotFound):
        message = f"There is no endpoint at {req.path}: see /api/docs for the endpoints."
    elif status == 405:
        allowed = resp.get_header("Allow") or ""
        message = f"{req.method} is not allowed on {req.path}" + (
            f": use {allowed}." if allowed else "."
        )
    resp.media = {"error": CODES.get(status, "error"), "message": _sentence(message)}
    resp.content_type = falcon.MEDIA_JSON


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _raise(status: int, message: str):
    def handler(req, resp, ex, params):
        raise ApiError(status, message.format(ex=ex))

    return handler


def _cancelled(ex: BaseException) -> bool:
    """Whether ``ex`` is PostgreSQL cancelling a statement (its ``statement_timeout``),
    possibly wrapped by SQLAlchemy or by the broker's connection-error translation."""
    seen = 0
    while ex is not None and seen < 5:
        if isinstance(ex, psycopg.errors.QueryCanceled):
            return True
        ex = getattr(ex, "orig", None) or ex.__cause__
        seen += 1
    return False


def _busy(req, resp, ex, params):
    raise ApiError(429, f"{ex}.", headers={"Retry-After": "1"})


def _unavailable(req, resp, ex, params):
    if _cancelled(ex):
        logger.warning("Statement timeout while serving %s %s", req.method, req.path)
        raise ApiError(
            503,
            "The query took longer than the API's statement timeout "
            "(DRAMATIQ_PG_STATEMENT_TIMEOUT) and was stopped: narrow the filters (a status, "
            "a queue, an actor, a created_after/created_before range) or retry later.",
            headers={"Retry-After": "5"},
        )
    logger.warning("Database unavailable while serving %s %s: %s", req.method, req.path, ex)
    raise ApiError(
        503, "The database is unavailable; try again shortly (see /api/health for details)."
    )


def _internal(req, resp, ex, params):
    # Falcon calls this only for exceptions no other handler claimed: a bug, never bad
    # input. The client gets the error shape; the traceback goes to the log.
    if isinstance(ex, falcon.HTTPError):
        raise ex
    logger.exception("Unhandled error while serving %s %s", req.method, req.path)
    raise ApiError(500, "The server failed to handle this request; the error was logged.")


def _programming(req, resp, ex, params):
    if isinstance(getattr(ex, "orig", None), psycopg.errors.UndefinedTable):
        raise ApiError(
            503,
            f"{ex.orig.diag.message_primary}: the tables are missing; run "
            "`dramatiq-pg-broker migrate` with the API's DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA.",
        )
    _internal(req, resp, ex, params)


def add_error_handlers(app: falcon.App) -> None:
    """Map domain and infrastructure errors to HTTP statuses, once for every resource."""
    app.set_error_serializer(serialize_error)
    # The most generic first: Falcon picks the handler of the nearest base class.
    app.add_error_handler(Exception, _internal)
    app.add_error_handler(JobNotFound, _raise(404, "{ex}: check the job id."))
    app.add_error_handler(WorkflowNotFound, _raise(404, "{ex}: check the workflow id."))
    app.add_error_handler(InvalidTransition, _raise(409, "{ex}."))
    app.add_error_handler(JobBusy, _raise(409, "{ex}."))
    app.add_error_handler(QueueNotDeclared, _raise(404, "{ex}."))
    app.add_error_handler(InvalidQueueName, _raise(400, "{ex}."))
    app.add_error_handler(InvalidQueueLimit, _raise(400, "{ex}."))
    app.add_error_handler(InvalidAccountData, _raise(400, "{ex}."))
    app.add_error_handler(EmailTaken, _raise(409, "{ex}."))
    app.add_error_handler(LastAdmin, _raise(409, "{ex}."))
    app.add_error_handler(HashingBusy, _busy)
    app.add_error_handler(UserNotFound, _raise(404, "{ex}."))
    app.add_error_handler(TokenNotFound, _raise(404, "{ex}."))
    app.add_error_handler(SchemaMissing, _raise(503, "{ex}."))
    # The schema handshake's refusals (logged once by schema_check.py).
    app.add_error_handler(SchemaVersionError, _raise(503, "{ex}."))
    app.add_error_handler(sqlalchemy.exc.ProgrammingError, _programming)
    for error in (
        BrokerConnectionError,
        psycopg.OperationalError,
        psycopg_pool.PoolTimeout,
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.TimeoutError,
    ):
        app.add_error_handler(error, _unavailable)

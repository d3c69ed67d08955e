"""Turning a Dramatiq message into a job row, and a stored row back into a message.

Every writer of new jobs (``broker.enqueue``, bulk and transactional sends, the admin API's
``POST /api/jobs``) goes through :func:`job_from_message`, so a send is validated, encoded
and scheduled the same way wherever it comes from, and its ``max_attempts`` derived by the
same rules (:func:`default_max_retries`, :func:`max_retries_of`, :func:`max_attempts_for`).

Fidelity: the stored ``message_bytes`` are exactly what the configured Dramatiq encoder
(``dramatiq.get_encoder()``) produced, and a worker decodes those bytes with the same
encoder. The ``message`` jsonb column is only a view for display and filters: jsonb
re-orders keys, turns ``1e20`` into an integer and ``-0.0`` into ``0``, and cannot hold
``NaN``, ``Infinity`` or ``"\\u0000"``, so it never feeds a worker.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Iterable
from typing import Any

import dramatiq
from dramatiq.common import current_millis
from dramatiq.encoder import JSONEncoder
from dramatiq.middleware.retries import Retries as DramatiqRetries

from ..config import Settings
from ..errors import InvalidMessage
from ..jobs.rows import NewJob
from .unique import UNIQUE_SCOPE, unique_key, unique_of

#: The range of ``priority`` (a PostgreSQL integer).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: Largest max_attempts a job row takes (an actor allowing unlimited retries gets this).
UNLIMITED_ATTEMPTS = 2**31 - 1
#: The furthest in the future a message may be scheduled (``delay`` or ``eta``): ten years,
#: in milliseconds.
MAX_DELAY_MS = 10 * 365 * 86_400_000
#: The longest idempotency key, in UTF-8 bytes (it is a unique-index entry).
MAX_IDEMPOTENCY_KEY_BYTES = 1000
#: The scope of idempotency keys sent by the application (see :func:`idempotency_scope`).
APPLICATION_SCOPE = ""

# Only these sequences can make the JSON that Python's json module writes unacceptable to
# jsonb: NaN and Infinity are not JSON, and jsonb refuses "\u0000" and lone surrogates.
_JSONB_SUSPECTS = re.compile(rb"NaN|Infinity|\\u0000|\\ud")
#: A message id as Dramatiq writes it (uuid4, canonical form): no parsing needed.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def default_max_retries(settings: Settings, middleware: Iterable[Any] = ()) -> int | None:
    """The ``max_retries`` of a message whose actor sets none: the one rule that every
    writer of job rows (sends, the admin API) and this package's Retries middleware follow.

    It is the ``max_retries`` of the process's Retries middleware when it has one (this
    package's takes ``max_attempts - 1`` of its broker's settings unless its constructor
    was given another; Dramatiq's own has 20), else ``settings.max_attempts - 1``: with the
    default middleware, ``DRAMATIQ_PG_MAX_ATTEMPTS`` sets it for sends and for jobs the
    admin API creates alike. None means unlimited.

    Parameters:
      settings(Settings): the process's settings.
      middleware(list[Middleware]): the broker's middleware; none for a process without a
        broker (the admin API).
    """
    for m in middleware:
        if isinstance(m, DramatiqRetries):
            return m.max_retries
    return settings.max_attempts - 1


def max_attempts_for(max_retries: int | None, failures: int = 0) -> int:
    """The row's ``max_attempts`` for a ``max_retries`` (None: unlimited), and never fewer
    than ``failures + 1``: a row always allows the attempt its retry policy just granted
    (a ``retry_when`` policy, or Dramatiq's own Retries with another default, may retry
    past the ``max_retries`` the row was written with)."""
    limit = UNLIMITED_ATTEMPTS if max_retries is None else int(max_retries) + 1
    return max(1, min(max(limit, failures + 1), UNLIMITED_ATTEMPTS))


def max_retries_of(
    options: dict[str, Any], actor_options: dict[str, Any], default: int | None
) -> int | None:
    """The ``max_retries`` that applies to a message with these ``options``: its own
    option, else its actor's, else ``default`` (:func:`default_max_retries`). None means
    unlimited. The row's ``max_attempts`` is :func:`max_attempts_for` of it."""
    return options.get("max_retries", actor_options.get("max_retries", default))


def failures_of(options: dict[str, Any]) -> int:
    """The failed attempts a message has behind it: its ``retries`` option, as Dramatiq's
    Retries middleware counts them (the consumer sets it from the row)."""
    retries = options.get("retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int):
        return 0
    return max(0, retries)


def idempotency_scope(namespace: str | None = None) -> str:
    """The scope an idempotency key is unique in, together with the actor's name.

    The application's sends use the empty scope. Another writer that must never collide
    with the application's keys (the admin API, one scope per member) passes its own
    namespace, for example ``idempotency_scope("member:42")``.
    """
    if namespace is None or namespace == "":
        return APPLICATION_SCOPE
    if "\x00" in namespace:
        raise ValueError("an idempotency scope cannot contain a NUL character")
    if namespace == UNIQUE_SCOPE:
        raise ValueError(f"the idempotency scope {UNIQUE_SCOPE!r} is the unique jobs' own")
    return str(namespace)


def _check_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidMessage(f"idempotency_key must be a string, got {type(key).__name__} {key!r}")
    if key == "":
        raise InvalidMessage("idempotency_key must not be empty (leave it out for no key)")
    if "\x00" in key:
        raise InvalidMessage("idempotency_key must not contain a NUL character")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidMessage("idempotency_key must be valid Unicode text") from None
    if size > MAX_IDEMPOTENCY_KEY_BYTES:
        raise InvalidMessage(
            f"idempotency_key must be at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes in UTF-8, "
            f"got {size}"
        )
    return key


def _check_int(name: str, value: Any, low: int, high: int, unit: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidMessage(f"{name} must be an integer from {low} to {high}{unit}, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise InvalidMessage(f"{name} must be an integer from {low} to {high}{unit}, got {value}")
    if not low <= value <= high:
        raise InvalidMessage(f"{name} must be an integer from {low} to {high}{unit}, got {value}")
    return int(value)


def delay_of(message: dramatiq.Message, delay: Any) -> int:
    """Milliseconds until the message may run: ``delay`` or its ``eta`` option (epoch
    milliseconds), whichever is later.

    Raises:
      InvalidMessage: either is not a number, or lies beyond :data:`MAX_DELAY_MS`.
    """
    delay_ms = 0
    if delay is not None:
        delay_ms = _check_int("delay", delay, 0, MAX_DELAY_MS, " milliseconds")
    eta = message.options.get("eta")
    if eta is not None:
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta):
            raise InvalidMessage(f"eta must be a time in epoch milliseconds, got {eta!r}")
        wait = int(eta) - current_millis()
        if wait > MAX_DELAY_MS:
            raise InvalidMessage(
                f"eta must be at most {MAX_DELAY_MS} milliseconds (ten years) from now, "
                f"got {eta} ({wait} ms from now)"
            )
        delay_ms = max(delay_ms, wait)
    return delay_ms


class StoredMessage:
    """A message as the row holds it: the encoder's bytes (authoritative) and how the
    display view is made.

    Attributes:
      data(bytes): what ``dramatiq.get_encoder().encode`` produced.
      view(Any): a display-safe JSON value written as the jsonb view, or None.
      view_from_bytes(bool): the bytes are JSON jsonb holds as it is; the server parses
        them into the view (no second copy is sent).
    """

    __slots__ = ("data", "view", "view_from_bytes")

    def __init__(self, data: bytes, view: Any = None, view_from_bytes: bool = False) -> None:
        self.data = data
        self.view = view
        self.view_from_bytes = view_from_bytes


#: What Dramatiq's stock JSONEncoder runs (``json.dumps(data, separators=(",", ":"))``),
#: built once: ``json.dumps`` with any argument builds a new encoder object per call.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
#: The fields of ``dramatiq.Message``, in the order ``Message.asdict()`` lists them.
_MESSAGE_FIELDS = tuple(f.name for f in dataclasses.fields(dramatiq.Message))


def _encoded(encoder: Any, message: dramatiq.Message) -> Any:
    if type(encoder) is JSONEncoder and type(message) is dramatiq.Message:
        # The same bytes as encoder.encode(message.asdict()), without the per-call costs
        # that dominate a bulk enqueue of small messages.
        fields = {name: getattr(message, name) for name in _MESSAGE_FIELDS}
        return _COMPACT_JSON.encode(fields).encode("utf-8")
    return encoder.encode(message.asdict())


def encode(message: dramatiq.Message) -> StoredMessage:
    """Encode a message with the configured Dramatiq encoder.

    Raises:
      InvalidMessage: the encoder cannot encode the message (a value it does not support).
    """
    encoder = dramatiq.get_encoder()
    try:
        data = _encoded(encoder, message)
    except Exception as e:
        raise InvalidMessage(
            f"the message for actor {message.actor_name!r} cannot be encoded by "
            f"{type(encoder).__name__}: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidMessage(
            f"{type(encoder).__name__}.encode returned {type(data).__name__}, not bytes"
        )
    data = bytes(data)
    if not isinstance(encoder, JSONEncoder):
        return StoredMessage(data)
    if type(encoder) is JSONEncoder and _JSONB_SUSPECTS.search(data) is None:
        # The stock encoder writes plain ASCII JSON: without the suspects, jsonb takes it.
        return StoredMessage(data, view_from_bytes=True)
    return StoredMessage(data, view=display_view(data))


def display_view(data: bytes) -> Any:
    """A JSON value jsonb can hold, for showing a JSON message: ``NaN`` and ``Infinity``
    become strings, NUL characters and lone surrogates become U+FFFD. None when the bytes
    are not JSON at all."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=str)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return _safe(value)


def _safe(value: Any) -> Any:
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)
        return value
    if isinstance(value, dict):
        return {_safe(k): _safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_safe(v) for v in value]
    return value


def decode(view: Any, data: bytes | None) -> dramatiq.Message:
    """Rebuild a message from its row: from the encoder's bytes when present (every row
    written since the bytes became authoritative), else from an older row's jsonb.

    Raises:
      dramatiq.errors.DecodeError: the bytes cannot be decoded by the configured encoder.
    """
    if data is not None:
        return dramatiq.Message.decode(bytes(data))
    if isinstance(view, (str, bytes)):
        return dramatiq.Message.decode(view.encode() if isinstance(view, str) else view)
    fields = dict(view)
    fields["args"] = tuple(fields.get("args") or ())
    return dramatiq.Message(**fields)


def job_from_message(
    message: dramatiq.Message,
    *,
    delay: Any = None,
    actor_priority: int = 0,
    actor_options: dict[str, Any] | None = None,
    default_max_retries: int | None,
    scope: str = APPLICATION_SCOPE,
    durable: bool = True,
) -> tuple[NewJob, dramatiq.Message]:
    """The one place a message becomes a job row.

    Parameters:
      message(Message): the message to send.
      delay(int): milliseconds to wait before it may run (Dramatiq's ``delay``).
      actor_priority(int): the actor's ``priority`` (the message's option wins).
      actor_options(dict): the actor's options (``max_retries``), if the actor is known.
      default_max_retries(int): the ``max_retries`` of an actor that sets none, from
        :func:`default_max_retries` (None: unlimited).
      scope(str): the idempotency scope (see :func:`idempotency_scope`); a unique job's
        key has a scope of its own (see :mod:`.unique`).
      durable(bool): the broker's ``durable_sends``; the message's ``durable`` option wins.

    Returns:
      tuple: the :class:`NewJob` to insert, and the message as stored (an ``eta`` option is
      dropped: the row's ``available_at`` does the waiting).

    Raises:
      InvalidMessage: an option is out of range, or the encoder cannot encode a value.
    """
    options = message.options
    job_id = message.message_id
    if not isinstance(job_id, str) or _CANONICAL_UUID.fullmatch(job_id) is None:
        try:
            # The row's id in PostgreSQL's spelling, so that results match it.
            job_id = str(uuid.UUID(job_id))
        except (TypeError, ValueError, AttributeError):
            raise InvalidMessage(f"message_id must be a UUID, got {job_id!r}") from None
    delay_ms = delay_of(message, delay)
    if "eta" in options:
        message = message.copy()
        message.options.pop("eta", None)
    priority = _check_int(
        "priority", options.get("priority", actor_priority), PRIORITY_MIN, PRIORITY_MAX
    )
    max_retries = max_retries_of(options, actor_options or {}, default_max_retries)
    if max_retries is not None:
        _check_int("max_retries", max_retries, 0, UNLIMITED_ATTEMPTS - 1)
    key = _check_key(options.get("idempotency_key"))
    # A message's own idempotency key wins over its actor's unique option (a periodic
    # schedule's tick key, say), as any message option wins over the actor's.
    unique, unique_for_ms = unique_of(options, {} if key is not None else actor_options or {})
    if unique:
        if key is not None:
            raise InvalidMessage(
                "a unique job cannot have an idempotency_key: its key is derived from its "
                "actor, queue and arguments (send with unique=False to use your own key)"
            )
        # One key for every sender: the application's and the admin API's members alike.
        key, scope = unique_key(message), UNIQUE_SCOPE
    durable = options.get("durable", durable)
    if not isinstance(durable, bool):
        raise InvalidMessage(f"durable must be True or False, got {durable!r}")
    stored = encode(message)
    job = NewJob(
        id=job_id,
        queue_name=message.queue_name,
        actor_name=message.actor_name,
        message=stored.view,
        message_bytes=stored.data,
        message_view_from_bytes=stored.view_from_bytes,
        priority=priority,
        delay_ms=delay_ms,
        max_attempts=max_attempts_for(max_retries, failures_of(options)),
        idempotency_key=key,
        idempotency_scope=scope,
        durable=durable,
        sent_at_ms=_sent_at_ms(message),
        unique_for_ms=unique_for_ms,
    )
    return job, message


#: Message timestamps outside these bounds (milliseconds since the epoch: 2001 to 2286)
#: are not trusted to bound the send's probe of history (see NewJob.sent_at_ms).
_SENT_AT_RANGE = (10**12, 10**13)


def _sent_at_ms(message) -> int | None:
    stamp = getattr(message, "message_timestamp", None)
    if type(stamp) is int and _SENT_AT_RANGE[0] <= stamp < _SENT_AT_RANGE[1]:
        return stamp
    return None

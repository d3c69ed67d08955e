"""The job store's values: what a send, a claim, a renewal and the reaper hand back and
take, and the small helpers every part of the store shares."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import math
import uuid
from typing import Any, NamedTuple

from psycopg.types.json import Jsonb

from ..errors import InvalidJobId


class Attempt(NamedTuple):
    """One claimed attempt of a job: what every guarded transition must match."""

    id: str
    owner: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class ClaimedJob:
    """A job row just claimed, with what the consumer needs to rebuild the message."""

    id: str
    priority: int
    attempts: int
    max_attempts: int
    message: dict[str, Any] | None
    message_bytes: bytes | None
    #: Earlier attempts of this job that failed (exception or time limit).
    failures: int = 0
    #: Earlier claims of this job whose lease expired before a start was recorded.
    abandoned_claims: int = 0
    #: An operator asked for this job's abort (a worker of the previous release requeued
    #: it anyway): it must be cancelled, not run.
    abort_requested: bool = False


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one claim statement returned: the jobs claimed or, when there were none, when
    the queue's earliest waiting job becomes runnable."""

    jobs: list[ClaimedJob]
    #: None unless nothing was claimed and a job waits: its available_at (server clock).
    next_available_at: dt.datetime | None = None
    #: Seconds, by the server's clock, until then (0 or less: runnable now).
    seconds_until_available: float | None = None
    #: None unless nothing was claimed: seconds until the earliest lease of any running job
    #: (any queue, any worker) expires (0 or less: one has expired; ``math.inf``: no job
    #: runs). The reaper has nothing to do before then (:meth:`.LeaseKeeper.leases_report`).
    lease_seconds_left: float | None = None
    #: True when nothing was claimed because an operator paused the queue (no wait is
    #: reported then: nothing there becomes runnable by itself).
    paused: bool = False
    #: The queue's limit as a limited claim read it (:meth:`JobStore.claim_limited`; None:
    #: no limit, or a plain claim).
    queue_limit: int | None = None
    #: True when a limited claim found the queue at its limit and claimed nothing.
    at_limit: bool = False


#: The scope of the keys of unique jobs in ``job_keys`` (an application's idempotency keys
#: have the empty scope, the admin API's one per member: ``member:<id>``); see
#: :mod:`dramatiq_pg_broker.sending.unique`.
UNIQUE_SCOPE = "unique"


# Not frozen: a frozen dataclass's __init__ costs three times as much, which a bulk enqueue
# of 100,000 messages pays 100,000 times. Nothing changes a NewJob once built.
@dataclasses.dataclass(slots=True)
class NewJob:
    """What :meth:`JobStore.enqueue` stores: one encoded message and its scheduling.

    Build it with :func:`dramatiq_pg_broker.messages.job_from_message`, which validates
    and encodes. ``message_bytes`` is what workers decode; ``message`` is the jsonb view
    for display when it differs from the bytes (with ``message_view_from_bytes`` none is
    stored: the view ``all_jobs`` parses the bytes on read). A job with only ``message``
    is an older row's form, still readable.
    """

    id: str
    queue_name: str
    actor_name: str
    message: Any = None
    message_bytes: bytes | None = None
    priority: int = 0
    delay_ms: int = 0
    #: The limit :func:`~dramatiq_pg_broker.messages.max_attempts_for` derives: required,
    #: so that every writer of a row states it (the column's default is never relied on).
    max_attempts: int = dataclasses.field(kw_only=True)
    idempotency_key: str | None = None
    message_view_from_bytes: bool = False
    idempotency_scope: str = ""
    #: False: the send's own commit does not wait for its WAL flush (see
    #: ``Settings.durable_sends``); ignored in a transaction the caller holds.
    durable: bool = True
    #: The message's timestamp (Dramatiq's ``message_timestamp``, milliseconds since the
    #: epoch): its job cannot have finished before it, so the send's probe of the history
    #: for the same id reads only the partitions from then on. None probes them all.
    sent_at_ms: int | None = None
    #: A unique job's period (``unique_for``, milliseconds from the send) during which its
    #: key stays held whatever the job's state; None: no period (see
    #: :mod:`dramatiq_pg_broker.sending.unique`).
    unique_for_ms: int | None = None


class EnqueueResult(NamedTuple):
    """The stored job: ``created`` is False when an existing job (same message id or
    idempotency key) was returned instead; ``rescheduled`` is True when a waiting or
    running job with the same id was moved back to queued with the new message."""

    id: str
    created: bool
    status: str
    message: Any
    message_bytes: bytes | None
    rescheduled: bool = False


class ReapedJob(NamedTuple):
    """A job the reaper failed: its interruptions reached the bound."""

    id: str
    queue_name: str
    actor_name: str
    message: dict[str, Any] | None
    message_bytes: bytes | None
    failures: int
    interruptions: int
    error: str


class ReapResult(NamedTuple):
    """What one reaper run did: ``requeued`` interrupted attempts, ``released`` claims that
    never started (uncharged), ``failed`` jobs whose interruptions reached the bound,
    ``aborted`` jobs whose abort was requested (cancelled instead of requeued)."""

    requeued: list[str]
    failed: list[str]
    released: list[str] = []
    failed_jobs: list[ReapedJob] = []
    aborted: list[str] = []


class Renewal(NamedTuple):
    """What a lease renewal found: the attempts still ``owned``, and those of them whose
    abort an operator requested (``abort_requested``)."""

    owned: set[str]
    abort_requested: set[str]


#: The NOTIFY payload that asks the holder of a job's attempt to abort it:
#: ``abort:<job id>`` on the job's queue channel. The payload-free NOTIFY of an enqueue
#: only says "look"; a pause says ``pause``.
ABORT_PAYLOAD_PREFIX = "abort:"
#: The NOTIFY payload of a queue that was just paused (its consumers give back what they
#: prefetched).
PAUSE_PAYLOAD = "pause"


#: What a send writes of a :class:`NewJob`, in one order, each value with the type it is
#: sent as: the parameters of ``insert_job``, ``find_existing`` and ``reenqueue_job``, the
#: arrays of ``insert_jobs`` and the columns of the staging table (a unit test holds the
#: statements to this list). :func:`send_values` gives the values; the binary COPY of
#: :meth:`JobStore._copy_new` writes the stored row the server computes from them
#: (``available_at`` from ``delay_ms``). ``message`` is None where jsonb holds the bytes as
#: they are (``message_view_from_bytes``): the view ``all_jobs`` parses them on read.
SEND_FIELDS: tuple[tuple[str, str], ...] = (
    ("id", "text"),
    ("queue_name", "text"),
    ("actor_name", "text"),
    ("message", "jsonb"),
    ("message_bytes", "bytea"),
    ("priority", "int4"),
    ("delay_ms", "int8"),
    ("max_attempts", "int4"),
    ("idempotency_key", "text"),
    ("idempotency_scope", "text"),
    ("sent_at_ms", "int8"),
    ("unique_for_ms", "int8"),
)
SEND_NAMES = tuple(name for name, _ in SEND_FIELDS)


def send_values(job: NewJob) -> tuple:
    """The values of :data:`SEND_FIELDS` for ``job``: the one encoder of a job for every
    statement that writes it (its jsonb view wrapped for psycopg, its delay never below
    zero)."""
    return (
        job.id,
        job.queue_name,
        job.actor_name,
        Jsonb(job.message) if job.message is not None else None,
        job.message_bytes,
        job.priority,
        _delay_ms(job),
        job.max_attempts,
        job.idempotency_key,
        job.idempotency_scope,
        job.sent_at_ms,
        job.unique_for_ms,
    )


def _delay_ms(job: NewJob) -> int:
    return max(0, int(job.delay_ms))


#: How the error the reaper records for an expired lease begins (``reap_expired``); the
#: monitoring tells a lost lease from an actor's failure by it.
LEASE_EXPIRED = "lease expired:"


class AsDict:
    """A dataclass value that the CLI prints as JSON and the admin API returns:
    :meth:`as_dict` is its fields, as :func:`dataclasses.asdict` gives them."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _claim_of(rows: list[tuple]) -> Claim:
    """The rows of the claim statement as a :class:`Claim`."""
    if len(rows) == 1 and rows[0][0] is None:
        left = rows[0][11]
        return Claim(
            [], rows[0][9], rows[0][8], math.inf if left is None else left, bool(rows[0][13])
        )
    return Claim([ClaimedJob(str(r[0]), *r[1:8], abort_requested=r[12]) for r in rows])


def channel_name(schema: str, queue_name: str) -> str:
    """The LISTEN/NOTIFY channel of a queue: ``schema.queue``, hashed when longer than
    PostgreSQL's 63-byte identifier limit."""
    name = f"{schema}.{queue_name}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(queue_name.encode()).hexdigest()
    return f"{schema}.{digest}"[:63]


def abort_payload(job_id: str) -> str:
    """The NOTIFY payload asking the holder of ``job_id``'s attempt to abort it."""
    return ABORT_PAYLOAD_PREFIX + str(job_id)


def clean_text(text: str | None) -> str | None:
    """Text PostgreSQL can store: a NUL character or a lone surrogate (``os.listdir``
    returns those for names that are not UTF-8) would make the whole statement fail, so
    they are written as backslash escapes."""
    if text is None:
        return None
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


#: The fewest hex characters a job id prefix must have: the 8 the demo and the CLI print.
#: With a million jobs, about a hundred pairs of ids share their first 8 characters; the
#: resolver then lists the candidates.
MIN_ID_PREFIX = 8
#: The most jobs an ambiguous prefix lists.
MAX_ID_CANDIDATES = 10

_HEX = frozenset("0123456789abcdef")


def id_prefix_range(text: str) -> str | tuple[str, str]:
    """Read a job id or a prefix of one.

    Returns:
      str | tuple[str, str]: the canonical id for a whole UUID; for a prefix, the lowest
      and highest ids that start with it (the prefix padded with ``0`` and with ``f``).

    Raises:
      InvalidJobId: neither a UUID nor a prefix of at least :data:`MIN_ID_PREFIX` hex
        characters.
    """
    given = text.strip()
    digits = given.lower().replace("-", "")
    if len(digits) == 32 and set(digits) <= _HEX:
        return str(uuid.UUID(digits))
    try:
        return str(uuid.UUID(given))  # {braces} and urn:uuid: forms
    except ValueError:
        pass
    if not digits or not set(digits) <= _HEX or len(digits) > 32:
        raise InvalidJobId(
            f"{given!r} is not a job id: give the UUID, or at least its first "
            f"{MIN_ID_PREFIX} hex characters"
        )
    if len(digits) < MIN_ID_PREFIX:
        raise InvalidJobId(
            f"job id prefix {given!r} is too short: give at least {MIN_ID_PREFIX} hex characters"
        )
    low = uuid.UUID(digits.ljust(32, "0"))
    high = uuid.UUID(digits.ljust(32, "f"))
    return str(low), str(high)

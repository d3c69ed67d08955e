"""Queue control: the queues workers declared, and pausing and resuming them.

A queue becomes known when a worker that consumes it boots (:func:`declare`); its row in
``<schema>.queues`` then stays, so its state outlives every worker. :func:`pause` sets the
row's flag and records who did it and when; from its commit on, the claim statement of
every worker on every host returns nothing for that queue (it reads the flag by primary
key in the same statement, so there is no cache to go stale). Sends are still accepted:
the jobs wait. The queue's consumers are told at once (a NOTIFY) and give back, uncharged,
the messages they claimed and had not started; jobs already running finish. :func:`resume`
clears the flag, records who and when, and wakes the consumers, which claim at once.

Workers of the previous release (0.1.0) do not read the flag: during a rolling upgrade they
still claim a paused queue's jobs.

The CLI (``dramatiq-pg-broker queues list|pause|resume``), the admin API
(``POST /api/queues/{name}/pause|resume``) and the dashboard call these functions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Iterable

import psycopg

from ..db.queries import statements_for
from ..errors import QueueNotDeclared
from ..jobs.rows import PAUSE_PAYLOAD, AsDict, channel_name, clean_text

# The one definition of a queue name (the settings, the CLI and the admin API use it too).
from ..queue_rules import check_queue_name as check_name


@dataclasses.dataclass(frozen=True)
class QueueState(AsDict):
    """A known queue and whether it is paused, with the latest pause and resume."""

    queue_name: str
    paused: bool
    paused_at: dt.datetime | None
    paused_by: str | None
    resumed_at: dt.datetime | None
    resumed_by: str | None
    declared_at: dt.datetime


#: The statements of queues.sql for a schema (loaded once per process, shared).
_queries = functools.partial(statements_for, filename="queues.sql")


def not_declared(name: str) -> str:
    """What every command says of a queue name that no worker declared (the CLI warns
    with it where it reads or retries jobs, and refuses with it where it would change the
    queue's state)."""
    shown = name if len(name) <= 60 else name[:60] + "..."
    return f"no worker has declared queue {shown!r}: check the name"


def is_declared(conn: psycopg.Connection, schema: str, name: str) -> bool:
    """Whether a worker declared the queue (or an operator paused it ahead of them)."""
    return get(conn, schema, name) is not None


def declare(conn: psycopg.Connection, schema: str, names: Iterable[str]) -> None:
    """Make queues known (a worker does it at boot); a known queue keeps its state."""
    names = sorted(set(names))
    if names:
        conn.execute(_queries(schema)["declare_queues"], {"names": names})


def get(conn: psycopg.Connection, schema: str, name: str) -> QueueState | None:
    """One known queue, or None."""
    cur = conn.execute(_queries(schema)["get_queue"], {"name": name})
    row = cur.fetchone()
    return None if row is None else QueueState(*row)


def states(conn: psycopg.Connection, schema: str) -> list[QueueState]:
    """Every known queue's state, by name."""
    return [QueueState(*row) for row in conn.execute(_queries(schema)["queue_states"])]


def pause(
    conn: psycopg.Connection, schema: str, name: str, *, by: str, force: bool = False
) -> QueueState:
    """Pause a queue: no worker claims its jobs from the commit on, and its consumers give
    back what they prefetched. Pausing a paused queue changes nothing (the first pause's
    author and time are kept).

    Parameters:
      conn(psycopg.Connection): where to run it (in its own transaction, or a savepoint
        of the caller's).
      schema(str): the broker's schema.
      name(str): the queue.
      by(str): who pauses it, as recorded.
      force(bool): pause a queue no worker declared yet (it becomes known, paused).

    Returns:
      QueueState: the queue after the change.

    Raises:
      QueueNotDeclared: no worker declared the queue (and ``force`` is False).
      InvalidQueueName: the name cannot be a queue's.
    """
    check_name(name)
    queries = _queries(schema)
    params = {"name": name, "by": clean_text(by) or "unknown"}
    with conn.transaction():
        changed = conn.execute(queries["pause_queue"], params).fetchone()
        if changed is None and force:
            changed = conn.execute(queries["pause_new_queue"], params).fetchone()
        state = get(conn, schema, name)
        if state is None:
            raise QueueNotDeclared(
                f"{not_declared(name)}, or pause it ahead of its workers with --force"
            )
        if changed is not None:
            conn.execute(
                queries["wake_queue"],
                {"channel": channel_name(schema, name), "payload": PAUSE_PAYLOAD},
            )
    return state


def resume(conn: psycopg.Connection, schema: str, name: str, *, by: str) -> QueueState:
    """Resume a paused queue and wake its consumers on every host. Resuming a queue that
    is not paused changes nothing.

    Raises:
      QueueNotDeclared: the queue is not known.
      InvalidQueueName: the name cannot be a queue's.
    """
    check_name(name)
    queries = _queries(schema)
    with conn.transaction():
        changed = conn.execute(
            queries["resume_queue"], {"name": name, "by": clean_text(by) or "unknown"}
        ).fetchone()
        state = get(conn, schema, name)
        if state is None:
            raise QueueNotDeclared(not_declared(name))
        if changed is not None:
            conn.execute(
                queries["wake_queue"], {"channel": channel_name(schema, name), "payload": ""}
            )
    return state

"""The worker registry: the worker processes running now, and the actors workers declared.

Every worker process writes one row of ``<schema>.workers`` when it boots (host, process
id, the queues it consumes and their actors, the package version and the schema level its
code ships, the highest migration: what ``migrate`` compares before a breaking migration,
when it started, and its connection budget: :attr:`.Settings.connection_budget`), and
refreshes it with the lease heartbeat it already runs (:mod:`.leases`): the time of the
beat, the attempts it holds (in flight). The row expires a lease after the last beat
(``lease_seconds``): a process that died or lost the database is gone from every list
then, and retention deletes its row. A clean exit deletes the row at once.

At the same boot the process declares its actors, each with its queue, in
``<schema>.actors`` and its queues in ``<schema>.queues`` (:mod:`.queues`). (The queue
limits it was configured with are written sooner, before its first claim: see
:mod:`.limits`.) Declared actors
outlive the workers that declared them, so an operator can enqueue through the admin API
while every worker is being redeployed; the admin API creates jobs only for declared
actors, on their own queue (see ``DRAMATIQ_PG_ADMIN_ADHOC_ACTORS``). An actor that is
renamed or removed keeps its row until someone deletes it (``DELETE FROM <schema>.actors
WHERE actor_name = ...``); nothing runs its jobs then.

The registry costs one statement per heartbeat interval per process (a third of the lease:
10 s by default), and three at boot. Processes of the previous release (0.1.0) do not
register: a rolling upgrade lists only the new ones.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import logging
import socket
import threading
import uuid
from collections.abc import Collection, Mapping, Sized
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import Middleware
from psycopg.types.json import Jsonb

from .. import forks
from ..config import Settings
from ..db.queries import statements_for
from .queues import declare as declare_queues

if TYPE_CHECKING:
    from ..db.core import ProcessPool
    from ..db.handshake import SchemaGate

logger = logging.getLogger("dramatiq_pg_broker.workers")


#: The statements of workers.sql for a schema (loaded once per process, shared).
_queries = functools.partial(statements_for, filename="workers.sql")


def list_workers(conn: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    """The live worker processes (their rows not expired), oldest first."""
    cur = conn.execute(_queries(schema)["list_workers"])
    names = [d.name for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def live_workers(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """How many live worker processes consume each queue (a queue none consumes now is
    left out)."""
    rows = conn.execute(_queries(schema)["live_workers_by_queue"]).fetchall()
    return {queue_name: int(n) for queue_name, n in rows}


def list_actors(conn: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    """Every declared actor with its queue and the number of live workers declaring it."""
    cur = conn.execute(_queries(schema)["list_actors"])
    names = [d.name for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def actor_queue(conn: psycopg.Connection, schema: str, actor_name: str) -> str | None:
    """The queue of a declared actor, or None if no worker ever declared it."""
    row = conn.execute(_queries(schema)["actor_queue"], {"name": actor_name}).fetchone()
    return None if row is None else row[0]


def actor_declaration(
    conn: psycopg.Connection, schema: str, actor_name: str
) -> tuple[str, dict[str, Any]] | None:
    """The queue of a declared actor and the options it was declared with (see
    :func:`declared_options`), or None if no worker ever declared it."""
    row = conn.execute(_queries(schema)["actor_declaration"], {"name": actor_name}).fetchone()
    return None if row is None else (row[0], dict(row[1] or {}))


def declared_options(actor: Any) -> dict[str, Any]:
    """What a worker records of an actor's options: its ``priority`` and every option it
    was declared with whose value is JSON (``max_retries``, ``min_backoff``,
    ``time_limit``, ...; never ``retry_when`` or ``throws``). The admin API creates jobs
    of the actor with them (see migration 0014)."""
    options: dict[str, Any] = {"priority": actor.priority}
    for name, value in actor.options.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        options[name] = value
    return options


def prune_expired(conn: psycopg.Connection, schema: str, *, limit: int = 1000) -> int:
    """Delete at most ``limit`` rows of worker processes whose registration expired (the
    retention run calls it, see :data:`.retention.RECLAIMERS`).

    Returns:
      int: how many rows were deleted.
    """
    return conn.execute(_queries(schema)["prune_workers"], {"limit": int(limit)}).rowcount


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Presence(Middleware):
    """This process in the registry: registers after the worker boots, is refreshed by the
    lease heartbeat (:meth:`refresh`), and deregisters when the worker shuts down.
    :class:`~dramatiq_pg_broker.PostgresBroker` installs it.

    A registration that cannot reach the database, or that waits for the worker's schema
    handshake, is retried by each heartbeat until it succeeds, actors and queues included.

    Parameters:
      pool(ProcessPool): where the rows are written (opened on first use).
      settings(Settings): the schema and the lease (the row's time to live).
      ledger(Ledger): the in-flight ledger (how many attempts the row reports).
      schema_gate(SchemaGate): nothing is written before the worker's handshake passed.
      actors(Mapping[str, Actor]): the broker's actors, read when the worker boots.
      queues(Collection[str]): the broker's declared queues, read when the worker boots.
    """

    pool: ProcessPool
    settings: Settings
    ledger: Sized
    schema_gate: SchemaGate
    actors: Mapping[str, Any]
    queues: Collection[str]

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._id: str | None = None
        self._started_at: dt.datetime | None = None
        self._queues: list[str] = []
        self._actors: list[tuple[str, str]] = []
        self._options: dict[str, dict[str, Any]] = {}
        self._declared = False
        self._gone = False

    @property
    def worker_id(self) -> str | None:
        """This process's id in the registry (``host:pid:random``), once it booted."""
        return self._id if self._pid == forks.pid() else None

    def after_worker_boot(self, broker, worker) -> None:
        consumed = getattr(worker, "consumers", None)
        queues = sorted(q for q in (consumed or self.queues) if q in self.queues)
        actors = list(self.actors.values())
        with self._lock:
            self._pid = forks.pid()
            self._id = f"{socket.gethostname()}:{self._pid}:{uuid.uuid4().hex[:8]}"
            self._started_at = dt.datetime.now(dt.timezone.utc)
            self._queues = queues
            self._actors = sorted((actor.actor_name, actor.queue_name) for actor in actors)
            self._options = {actor.actor_name: declared_options(actor) for actor in actors}
            self._declared = False
            self._gone = False
        try:
            self.refresh()
        except BrokerConnectionError as e:
            # The process's outage lines (outage.py) tell of the database; this is a detail.
            logger.debug("Could not register this worker (%s); the next heartbeat tries again.", e)
        except Exception:
            logger.exception("Could not register this worker; the next heartbeat tries again.")

    def refresh(self) -> None:
        """Write this process's row (and, until they are written once, its actors and
        queues). Does nothing before the worker booted, after it shut down, or in a forked
        child.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable.
        """
        if self._pid != forks.pid() or self._gone:
            # (Not booted yet: no pid.)
            return
        if not self.schema_gate.is_open:
            # The worker's schema handshake has not passed (handshake.SchemaGate): its boot
            # does not wait on the database, and the heartbeat registers it once it passed.
            return
        from ..db.handshake import this_code
        from ..version import __version__

        settings = self.settings
        queries = _queries(settings.schema)
        consumed = set(self._queues)
        params = {
            "id": self._id,
            "host": socket.gethostname(),
            "pid": self._pid,
            "queues": self._queues,
            "actors": [name for name, queue in self._actors if queue in consumed],
            "version": __version__,
            "schema_level": this_code().level,
            "started_at": self._started_at,
            "ttl_ms": int(settings.lease_seconds * 1000),
            "in_flight": len(self.ledger),
            "connections": settings.connection_budget,
        }
        with self.pool.connection() as conn:
            if self._declared:
                # A beat: one autocommit upsert (a transaction around it cost an idle
                # process two more round trips, BEGIN and COMMIT, per beat).
                conn.execute(queries["register_worker"], params)
                return
            with conn.transaction():
                declare_queues(conn, settings.schema, self._queues)
                if self._actors:
                    conn.execute(
                        queries["declare_actors"],
                        {
                            "names": [name for name, _ in self._actors],
                            "queues": [queue for _, queue in self._actors],
                            "options": [
                                Jsonb(self._options.get(name, {})) for name, _ in self._actors
                            ],
                        },
                    )
                conn.execute(queries["register_worker"], params)
        self._declared = True
        logger.info(
            "Registered worker %s: %d queue(s), %d actor(s).",
            self._id,
            len(self._queues),
            len(self._actors),
        )

    def after_worker_shutdown(self, broker, worker) -> None:
        if self._pid != forks.pid():
            # (Never booted, or booted in the parent of this forked process.)
            return
        self._gone = True
        if not self.schema_gate.is_open:
            # Stopped while it waited for the schema (a migration pending): it never wrote
            # its row, and the database would refuse this process anyway.
            return
        try:
            with self.pool.connection() as conn:
                conn.execute(_queries(self.settings.schema)["remove_worker"], {"id": self._id})
        except BrokerConnectionError as e:
            logger.warning("Could not deregister this worker (%s); its row expires.", e)

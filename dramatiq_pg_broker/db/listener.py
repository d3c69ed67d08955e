"""One LISTEN connection per process and database, shared by every blocking wait.

A reader blocked on a result (:mod:`.results`), a rate-limiter waiter (:mod:`.rate_limits`)
or dramatiq-abort's watcher (:mod:`.abort`, waiting for any of several keys) registers the
keys it waits for, makes sure the process listens on the key's channel, checks
the table once, and then sleeps until a NOTIFY with that key arrives or its deadline passes.
No thread polls the table on a timer.

The connection is dedicated (never pooled, since LISTEN is session state) and driven by one
daemon thread. When it breaks, the thread reconnects (at least twice a second, so that it
follows a failover within moments), listens again, and wakes every waiter so each checks
its table once more: a notification sent while the connection was down is never waited for
in vain. What it sees counts towards the process's outage (:mod:`.outage`), which logs it
once; the thread itself logs its reconnections at DEBUG.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
from dramatiq.errors import ConnectionClosed

from .. import forks
from ..service import Service
from . import outage
from .core import RECONNECT_CAP_SECONDS, connect, translate_errors

logger = logging.getLogger("dramatiq_pg_broker.listener")

T = TypeVar("T")

#: PostgreSQL's limit on a channel name (NAMEDATALEN - 1).
MAX_CHANNEL_BYTES = 63

#: Keys longer than this travel as their digest: a NOTIFY payload is limited to 8000 bytes.
MAX_PAYLOAD_BYTES = 200

#: Seconds between two checks that an idle listening connection is still alive.
HEALTH_CHECK_SECONDS = 30.0

#: Seconds between two looks of a waiter while the server refuses the LISTEN connection a
#: slot (saturation, see :func:`.outage.is_saturation`): it polls its table meanwhile.
SATURATED_POLL_SECONDS = 1.0
#: Longest pause between two tries to open the LISTEN connection on a saturated server.
SATURATED_RETRY_CAP_SECONDS = 5.0


def channel_for(schema: str, name: str) -> str:
    """The channel of one backend in one schema: ``schema:name``. A colon never occurs in a
    queue name, so this cannot collide with a queue's channel (``schema.queue``)."""
    channel = f"{schema}:{name}"
    if len(channel.encode()) <= MAX_CHANNEL_BYTES:
        return channel
    return channel_for(hashlib.sha1(schema.encode()).hexdigest()[:16], name)


def payload_for(key: str) -> str:
    """The NOTIFY payload naming ``key``: the key itself, or its digest when long."""
    if len(key.encode()) <= MAX_PAYLOAD_BYTES:
        return key
    return "#" + hashlib.sha256(key.encode()).hexdigest()


class Listener(Service):
    """The process's LISTEN connection to one database.

    Parameters:
      url(str): the database URL.
    """

    thread_name = "dramatiq-pg-listener"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self._lock = threading.Lock()
        # channel -> payload -> events of the threads waiting for it
        self._waiters: dict[str, dict[str, list[threading.Event]]] = {}
        # channel -> set once the current connection listens on it
        self._listening: dict[str, threading.Event] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._error: BaseException | None = None

    # -- waiting ---------------------------------------------------------------------------

    def wait_for(
        self,
        channel: str,
        key: str,
        check: Callable[[], T | None],
        timeout: float | None,
    ) -> T | None:
        """Return ``check()`` as soon as it gives something other than None, re-running it
        only when a notification for ``key`` arrives on ``channel``; None once ``timeout``
        seconds (None: no limit) have passed without.

        Raises:
          dramatiq.errors.ConnectionClosed: the listening connection cannot be opened.
        """
        return self.wait_for_any(channel, [key], check, timeout)

    def wait_for_any(
        self,
        channel: str,
        keys: list[str],
        check: Callable[[], T | None],
        timeout: float | None,
    ) -> T | None:
        """:meth:`wait_for`, woken by a notification for any of ``keys``.

        Raises:
          dramatiq.errors.ConnectionClosed: the listening connection cannot be opened.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        payloads = sorted({payload_for(key) for key in keys})
        event = threading.Event()
        for payload in payloads:
            self._register(channel, payload, event)
        try:
            while True:
                # Listen before looking: a result stored between the look and the LISTEN
                # would otherwise never wake us.
                listening = self._ensure_listening(channel, _remaining(deadline))
                if listening is False:
                    return check()
                event.clear()
                value = check()
                if value is not None:
                    return value
                remaining = _remaining(deadline)
                if remaining is not None and remaining <= 0:
                    return None
                if listening is None:
                    # The server has no slot for the LISTEN connection, but the pool's
                    # connections work: look now and then instead, quietly.
                    event.wait(min(SATURATED_POLL_SECONDS, remaining or SATURATED_POLL_SECONDS))
                elif not event.wait(remaining):
                    return None
        finally:
            for payload in payloads:
                self._unregister(channel, payload, event)

    def _register(self, channel: str, payload: str, event: threading.Event) -> None:
        with self._lock:
            self._waiters.setdefault(channel, {}).setdefault(payload, []).append(event)

    def _unregister(self, channel: str, payload: str, event: threading.Event) -> None:
        with self._lock:
            by_key = self._waiters.get(channel, {})
            events = by_key.get(payload, [])
            if event in events:
                events.remove(event)
            if not events:
                by_key.pop(payload, None)

    def _ensure_listening(self, channel: str, timeout: float | None) -> bool | None:
        """Make the thread listen on ``channel``; True once it does, False if that took
        longer than ``timeout``, None while the server refuses the connection a slot (the
        caller polls)."""
        with self._lock:
            if self._closed:
                raise ConnectionClosed(RuntimeError("the listener is closed"))
            ready = self._listening.get(channel)
            if ready is None:
                ready = self._listening[channel] = threading.Event()
                self._poke()
            self.start()
        if ready.is_set():
            return True
        if self._saturated():
            return None
        if timeout is not None and timeout <= 0:
            return False
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _remaining(end)
            step = SATURATED_POLL_SECONDS if left is None else min(SATURATED_POLL_SECONDS, left)
            if ready.wait(max(0.0, step)):
                return True
            if self._saturated():
                return None
            left = _remaining(end)
            if left is not None and left <= 0:
                break
        error = self._error
        if error is not None:
            raise ConnectionClosed(error) from error
        return False

    def _saturated(self) -> bool:
        """Whether the last try to open the connection was refused for want of slots."""
        error = self._error
        return error is not None and outage.is_saturation(error)

    def wake(self) -> None:
        self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # pragma: no cover - closed while poking
            pass

    # -- the thread ------------------------------------------------------------------------

    def run(self) -> None:
        delay = 0.05
        while not self.stopping.is_set():
            conn = None
            try:
                conn = connect(self.url)
                conn.add_notify_handler(self._dispatch)
                self._error = None
                delay = 0.05
                self._serve(conn)
            except Exception as e:  # a lost server: reconnect with backoff
                if self.stopping.is_set():
                    break
                # The driver's error, which waiters get wrapped in a ConnectionClosed.
                self._error = e.__cause__ if isinstance(e, ConnectionClosed) and e.__cause__ else e
                # Told once per outage by the process (outage.py), not at every try.
                logger.debug(
                    "The LISTEN connection of results, rate limits and aborts was lost: %s", e
                )
                with self._lock:
                    for ready in self._listening.values():
                        ready.clear()
                self._wake_everyone()
                time.sleep(delay)
                # A server out of connection slots is not helped by more attempts: retry
                # it less often than a server that went away.
                cap = (
                    SATURATED_RETRY_CAP_SECONDS
                    if outage.is_saturation(e)
                    else RECONNECT_CAP_SECONDS
                )
                delay = min(delay * 2, cap)
            finally:
                if conn is not None:
                    conn.close()

    def _serve(self, conn: psycopg.Connection) -> None:
        listened: set[str] = set()
        first = True
        while not self.stopping.is_set():
            with self._lock:
                wanted = [c for c in self._listening if c not in listened]
            for channel in wanted:
                with translate_errors():
                    conn.execute(f"LISTEN {_quote_ident(channel)}")
                outage.tracker.answered()
                listened.add(channel)
                with self._lock:
                    self._listening[channel].set()
            if first and listened:
                # A reconnection: whatever was notified while we were away is only in the
                # tables now, so every waiter looks again.
                self._wake_everyone()
            first = False
            readable, _, _ = select.select(
                [conn.fileno(), self._wake_r], [], [], HEALTH_CHECK_SECONDS
            )
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            if conn.fileno() in readable:
                with translate_errors(), conn.lock:
                    conn.pgconn.consume_input()
                    while (notify := conn.pgconn.notifies()) is not None:
                        conn.pgconn.notify_handler(notify)
                if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
                    with translate_errors():
                        raise psycopg.OperationalError("the listening connection was closed")
            elif not readable:
                with translate_errors():
                    conn.execute("SELECT 1")
                outage.tracker.answered()

    def _dispatch(self, notify: psycopg.Notify) -> None:
        with self._lock:
            events = list(self._waiters.get(notify.channel, {}).get(notify.payload, ()))
        for event in events:
            event.set()

    def _wake_everyone(self) -> None:
        with self._lock:
            events = [e for by_key in self._waiters.values() for es in by_key.values() for e in es]
        for event in events:
            event.set()

    def close(self) -> None:
        """Stop the thread and close the connection (waiters get ConnectionClosed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.stop(5)
        self._wake_everyone()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_listeners: dict[tuple[int, str], Listener] = {}
_listeners_lock = threading.Lock()


def listener_for(url: str) -> Listener:
    """The listener of this process for ``url`` (a forked child gets its own)."""
    key = (forks.pid(), url)
    with _listeners_lock:
        listener = _listeners.get(key)
        if listener is None or listener._closed:
            # Entries of a parent process are left alone: their thread does not exist here.
            listener = _listeners[key] = Listener(url)
        return listener

"""One LISTEN connection per process and database, shared by every consumer and every
blocking wait.

A reader blocked on a result (:mod:`.results`), a rate-limiter waiter (:mod:`.rate_limits`)
or dramatiq-abort's watcher (:mod:`.abort`, waiting for any of several keys) registers the
keys it waits for, makes sure the process listens on the key's channel, checks
the table once, and then sleeps until a NOTIFY with that key arrives or its deadline passes.
No thread polls the table on a timer.

A queue's consumer (:mod:`~..attempt.consumer`) subscribes to its queue's channel instead
(:meth:`Listener.subscribe`): it receives every payload sent there, in order, and reads
them in its own thread. So a worker process holds one LISTEN connection whatever the number
of its queues and threads (see its connection budget in the tuning guide).

The connection is dedicated (never pooled, since LISTEN is session state) and driven by one
daemon thread. When it breaks, the thread reconnects (at least twice a second, so that it
follows a failover within moments), listens again, and wakes every waiter so each checks
its table once more: a notification sent while the connection was down is never waited for
in vain, and gives every subscription an empty payload (a consumer's "look at the
queue"), which it also gets when its channel's LISTEN takes effect. What it sees counts
towards the process's outage (:mod:`.outage`), which logs it once; the thread itself logs
its reconnections at DEBUG. The connection stays open while anything subscribes or has
waited; when it is lost with nobody subscribed or waiting, or the last subscription closes
with nobody waiting, the thread ends and closes it (the next use opens it again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import threading
import time
from collections import deque
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


class Subscription:
    """Every notification of one channel, for one reader thread: a queue's consumer.

    The listener's thread appends each payload as it arrives; the reader takes them in
    its own thread (:meth:`take`, or :meth:`wait` to block for the next). An empty payload
    means "look": the channel's LISTEN took effect, or the connection was lost and is back
    (notifications sent meanwhile are lost).
    """

    def __init__(self, listener: Listener, channel: str) -> None:
        self.channel = channel
        self._listener = listener
        self._payloads: deque[str] = deque()
        self._ready = threading.Event()

    def deliver(self, payload: str) -> None:
        """Called by the listener's thread with each payload of the channel. A "look" right
        after another one not yet taken adds nothing (a busy queue's sends notify at every
        commit): the reader will look once for both."""
        if not payload:
            try:
                if self._payloads[-1] == "":
                    self._ready.set()
                    return
            except IndexError:  # none waiting (or the reader just took the last one)
                pass
        self._payloads.append(payload)
        self._ready.set()

    def take(self) -> list[str]:
        """The payloads that arrived since the last take, oldest first (no wait)."""
        # Cleared before the payloads are taken: one delivered meanwhile sets it again, so
        # the next wait returns at once instead of missing it.
        self._ready.clear()
        taken = []
        while self._payloads:
            taken.append(self._payloads.popleft())
        return taken

    def wait(self, timeout: float) -> list[str]:
        """The payloads that arrived, waiting up to ``timeout`` seconds for one when none
        has (an empty list after the wait: none came)."""
        if not self._payloads:
            self._ready.wait(max(0.0, timeout))
        return self.take()

    def close(self) -> None:
        """Stop receiving the channel's payloads."""
        self._listener.unsubscribe(self)


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
        # channel -> the subscriptions that receive its every payload
        self._subscriptions: dict[str, list[Subscription]] = {}
        #: Set when something subscribes or waits: a thread without a connection opens one.
        self._demand = threading.Event()
        #: Set when the last subscription closed with nobody waiting: the connection closes.
        self._release = False
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
            self._want()

    def _unregister(self, channel: str, payload: str, event: threading.Event) -> None:
        with self._lock:
            by_key = self._waiters.get(channel, {})
            events = by_key.get(payload, [])
            if event in events:
                events.remove(event)
            if not events:
                by_key.pop(payload, None)

    # -- subscribing -----------------------------------------------------------------------

    def subscribe(self, channel: str) -> Subscription:
        """Receive every payload of ``channel`` from now on (see :class:`Subscription`);
        the listener starts listening on it (without waiting: the subscription gets an
        empty payload once the LISTEN took effect).

        Raises:
          dramatiq.errors.ConnectionClosed: the listener is closed.
        """
        subscription = Subscription(self, channel)
        with self._lock:
            if self._closed:
                raise ConnectionClosed(RuntimeError("the listener is closed"))
            self._subscriptions.setdefault(channel, []).append(subscription)
            if channel not in self._listening:
                self._listening[channel] = threading.Event()
            self._want()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop delivering to ``subscription``; when nothing else subscribes or waits, the
        thread closes the connection (and opens it again at the next use)."""
        with self._lock:
            subscribed = self._subscriptions.get(subscription.channel, [])
            if subscription in subscribed:
                subscribed.remove(subscription)
            if not subscribed:
                self._subscriptions.pop(subscription.channel, None)
            if not self._wanted():
                self._release = True
                self._poke()

    def _wanted(self) -> bool:
        """Whether anything subscribes or waits now (under the lock)."""
        return bool(self._subscriptions) or any(
            events for by_key in self._waiters.values() for events in by_key.values()
        )

    def _want(self) -> None:
        """Something subscribes or waits (under the lock): the thread opens the connection
        if it has none, and keeps it."""
        self._release = False
        self._demand.set()
        self._poke()
        self.start()

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
            self._want()
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
        self._demand.set()
        self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # pragma: no cover - closed while poking
            pass

    # -- the thread ------------------------------------------------------------------------

    def _awaited(self) -> bool:
        """Wait until something subscribes or waits (at once if something does); False
        when the listener stops meanwhile."""
        while not self.stopping.is_set():
            with self._lock:
                if self._wanted():
                    self._release = False
                    return True
                self._demand.clear()
            self._demand.wait()
        return False

    def run(self) -> None:
        delay = 0.05
        while self._awaited():
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
                logger.debug("The process's LISTEN connection was lost: %s", e)
                self._unlisten_all()
                self._wake_everyone()
                if self.stopping.wait(delay):
                    break
                # A server out of connection slots is not helped by more attempts: retry
                # it less often than a server that went away. (Nobody subscribing or
                # waiting any more, a stopped worker or a dropped database, it is not
                # tried again at all until the next use: see _awaited.)
                cap = (
                    SATURATED_RETRY_CAP_SECONDS
                    if outage.is_saturation(e)
                    else RECONNECT_CAP_SECONDS
                )
                delay = min(delay * 2, cap)
            else:
                # Released: the last subscription closed with nobody waiting.
                self._unlisten_all()
            finally:
                if conn is not None:
                    conn.close()

    def _unlisten_all(self) -> None:
        with self._lock:
            for ready in self._listening.values():
                ready.clear()

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
                    subscribed = list(self._subscriptions.get(channel, ()))
                # Notifications sent before the LISTEN took effect were not heard: look.
                for subscription in subscribed:
                    subscription.deliver("")
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
                with self._lock:
                    if self._release and not self._wanted():
                        self._release = False
                        return
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
            subscribed = list(self._subscriptions.get(notify.channel, ()))
        for event in events:
            event.set()
        for subscription in subscribed:
            subscription.deliver(notify.payload)

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

"""``/metrics``: the queue as PostgreSQL sees it, in Prometheus' text format.

A scrape runs two statements: the per-queue counts (partial indexes only) and the events
written since the previous scrape (a range of the events' primary key). Gauges are the
database's truth at that moment, the same for every process that answers. Counters count
the events this process has read since its first scrape (Prometheus treats the start of a
process as a counter reset); each process keeps its own, so scrape one process: the
dedicated metrics app (:func:`admin_api.resources.metrics.create_metrics_app`, run with one
gunicorn worker) or an admin API run with ``ADMIN_API_WORKERS=1``.

Worker-side numbers (messages processed per actor, durations, in flight per worker
process) come from Dramatiq's own ``dramatiq.middleware.Prometheus`` on each worker host;
these are queue-side numbers, one series per queue, whichever host runs the work.

The ``queue`` label takes only the names of queues a worker declared (the queues table),
so its values are bounded by the deployment, not by what anyone sends: jobs of queues no
worker declared are counted together under ``queue="(undeclared)"`` (a name no Dramatiq
queue can have). ``dramatiq_pg_queue_paused`` is 1 for each paused queue, 0 otherwise.

The job gauges use the states of :mod:`dramatiq_pg_broker.jobs.states`, the words of the
CLI, the API and the dashboard: ``dramatiq_pg_jobs_ready``, ``_delayed``, ``_paused``,
``_running``, ``_lease_expired`` and ``_failed``. ``dramatiq_pg_jobs_queued`` (ready +
paused: runnable now) is the gauge of earlier releases, kept for their alerts.

The database's health comes from the checks of ``dramatiq-pg-broker doctor`` that read
the server's statistics views only (:data:`HEALTH_CHECKS`, one more short transaction per
scrape, see :class:`HealthCollector`): the age of the oldest snapshot holding the xmin
horizon back, the hot table's dead and live rows, size and last vacuum, sessions idle in
a transaction that hold job rows, connection slots and the live workers' budgets, the WAL
replication slots keep, and each check's level. The oldest waiting job of each queue is
``dramatiq_pg_oldest_waiting_seconds``, and the jobs whose lease expired
``dramatiq_pg_jobs_lease_expired``, above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dramatiq_pg_broker import events as event_types
from dramatiq_pg_broker.health.doctor import LEVELS, Report
from dramatiq_pg_broker.jobs import STATES, QueueCounts
from dramatiq_pg_broker.jobs.states import FAILED, UNFINISHED

from .monitoring import EVENT_SETTLE_SECONDS, Monitor, QueueOverview

#: Every metric's name starts with this.
PREFIX = "dramatiq_pg"

#: Finished-job outcomes, by the event that records them.
OUTCOMES = (event_types.SUCCEEDED, event_types.FAILED, event_types.CANCELLED)

#: The ``queue`` label of the jobs of every queue no worker declared.
UNDECLARED = "(undeclared)"


class QueueCollector(Collector):
    """A Prometheus collector that reads the database at each scrape.

    Parameters:
      monitor(Monitor): the monitoring reads.
      settle(float): events younger than this many seconds wait for the next scrape (see
        :meth:`Monitor.new_events`).
    """

    def __init__(self, monitor: Monitor, *, settle: float = EVENT_SETTLE_SECONDS) -> None:
        self.monitor = monitor
        self.settle = settle
        self._lock = threading.Lock()
        self._cursor: int | None = None
        self._events: dict[str, int] = {}
        self._lease_expiries = 0

    def describe(self) -> list[Metric]:
        # Known metric names without a database read at registration.
        return []

    def collect(self) -> Iterator[Metric]:
        # One scrape at a time per process: two at once would read the same events twice.
        with self._lock:
            started = time.perf_counter()
            # With no cursor yet, counting starts now: the history before this process is
            # not re-read.
            queues, new = self.monitor.scrape(self._cursor, settle=self.settle)
            elapsed = time.perf_counter() - started
            self._cursor = new.cursor
            for name, n in new.counts.items():
                self._events[name] = self._events.get(name, 0) + n
            self._lease_expiries += new.lease_expiries
            events = dict(self._events)
            lease_expiries = self._lease_expiries

        queues = _labelled(queues)
        for state in (*UNFINISHED, FAILED):
            family = GaugeMetricFamily(
                f"{PREFIX}_jobs_{state}",
                f"Jobs {STATES[state].label}: {STATES[state].description}.",
                labels=["queue"],
            )
            for queue, (counts, _) in queues.items():
                family.add_metric([queue], getattr(counts, state))
            yield family
        queued = GaugeMetricFamily(
            f"{PREFIX}_jobs_queued",
            "Jobs runnable now, ready or paused (the gauge of earlier releases: "
            "dramatiq_pg_jobs_ready and dramatiq_pg_jobs_paused tell them apart).",
            labels=["queue"],
        )
        for queue, (counts, _) in queues.items():
            queued.add_metric([queue], counts.ready + counts.paused)
        yield queued
        oldest = GaugeMetricFamily(
            f"{PREFIX}_oldest_waiting_seconds",
            "How long the oldest runnable job of the queue has been waiting (0: none waits).",
            labels=["queue"],
        )
        for queue, (counts, _) in queues.items():
            oldest.add_metric([queue], counts.oldest_waiting_seconds or 0.0)
        yield oldest
        paused = GaugeMetricFamily(
            f"{PREFIX}_queue_paused",
            "1 while an operator has paused the queue (no worker claims its jobs), else 0.",
            labels=["queue"],
        )
        for queue, (_, paused_now) in queues.items():
            if queue != UNDECLARED:
                paused.add_metric([queue], 1 if paused_now else 0)
        yield paused

        finished = CounterMetricFamily(
            f"{PREFIX}_jobs_finished",
            "Attempts that ended a job, by outcome, since this process started counting.",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            count = events.get(outcome, 0)
            if outcome == event_types.CANCELLED:
                # An abort ends a job cancelled with its own event.
                count += events.get(event_types.ABORTED, 0)
            finished.add_metric([outcome], count)
        yield finished
        yield CounterMetricFamily(
            f"{PREFIX}_retries",
            "Failed attempts rescheduled with a backoff.",
            value=events.get(event_types.RETRY_SCHEDULED, 0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_manual_retries",
            "Failed jobs an operator sent back to the queue.",
            value=events.get(event_types.MANUAL_RETRY, 0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_lease_expiries",
            "Attempts whose lease expired (worker died or hung): requeued or failed.",
            value=lease_expiries,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_claims",
            "Attempts claimed by workers.",
            value=events.get(event_types.CLAIMED, 0),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_metrics_query_seconds",
            "Database round trip of this scrape's metric queries.",
            value=elapsed,
        )


def _labelled(queues: dict[str, QueueOverview]) -> dict[str, tuple[QueueCounts, bool]]:
    """The declared queues by name, each with its counts and whether it is paused, and the
    jobs of all the others added up under :data:`UNDECLARED` (when there are any)."""
    labelled = {name: (q.jobs, q.paused) for name, q in queues.items() if q.declared}
    others = [q.jobs for q in queues.values() if not q.declared]
    if others:
        total = QueueCounts()
        for counts in others:
            total = total.add(counts)
        labelled[UNDECLARED] = (total, False)
    return labelled


#: The doctor's checks a scrape runs: those that read the server's statistics views and
#: the partial indexes of the jobs table (the queues' are read above; the partitions'
#: count of DEFAULT rows is left to the dashboard and the command).
HEALTH_CHECKS = (
    "schema",
    "snapshot",
    "hot_table",
    "idle_transactions",
    "expired_leases",
    "connections",
    "replication_slots",
)


class HealthCollector(Collector):
    """The figures of the doctor's checks (:data:`HEALTH_CHECKS`) as gauges, read at each
    scrape (see :meth:`Monitor.health`).

    Parameters:
      monitor(Monitor): the monitoring reads.
    """

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        report = self.monitor.health(HEALTH_CHECKS)
        yield from health_gauges(report)


def health_gauges(report: Report) -> Iterator[GaugeMetricFamily]:
    """The gauges of a doctor's report (a check that was skipped gives none of its own)."""

    def figure(check: str, name: str):
        found = report.finding(check)
        return None if found is None else found.figures.get(name)

    def gauge(name: str, help_text: str, value) -> Iterator[GaugeMetricFamily]:
        if value is not None:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)

    yield from gauge(
        "snapshot_age_seconds",
        "Age of the oldest open snapshot or transaction of the database (0: none): vacuum "
        "removes no row version that died after it.",
        figure("snapshot", "horizon_age_seconds"),
    )
    yield from gauge(
        "snapshot_xid_age",
        "Transactions between now and the database's xmin horizon (replication slots "
        "and prepared transactions included).",
        figure("snapshot", "horizon_xid_age"),
    )
    yield from gauge(
        "hot_table_dead_tuples",
        "Dead row versions of the jobs table, by the statistics collector.",
        figure("hot_table", "dead_tuples"),
    )
    yield from gauge(
        "hot_table_live_tuples",
        "Live rows of the jobs table (queued and running jobs), by the statistics collector.",
        figure("hot_table", "live_tuples"),
    )
    yield from gauge(
        "hot_table_bytes",
        "The jobs table's size on disk, indexes and TOAST included.",
        figure("hot_table", "total_bytes"),
    )
    yield from gauge(
        "hot_table_vacuum_age_seconds",
        "Seconds since the jobs table was last vacuumed (absent: never).",
        figure("hot_table", "vacuum_age_seconds"),
    )
    yield from gauge(
        "idle_transaction_seconds",
        "Longest a session has sat idle in a transaction that holds job rows (0: none).",
        figure("idle_transactions", "longest_idle_seconds"),
    )
    yield from gauge(
        "connections_used",
        "Client connections of the server now.",
        figure("connections", "used"),
    )
    yield from gauge(
        "connections_available",
        "max_connections less the reserved slots.",
        figure("connections", "available"),
    )
    yield from gauge(
        "worker_connection_budget",
        "Connections the live worker processes may open between them (each its "
        "pool_max_size plus one).",
        figure("connections", "worker_budgets"),
    )
    retained = figure("replication_slots", "retained_bytes")
    if retained is not None:
        slots = GaugeMetricFamily(
            f"{PREFIX}_replication_slot_retained_bytes",
            "WAL a replication slot keeps from being recycled.",
            labels=["slot"],
        )
        for slot, bytes_kept in retained.items():
            if bytes_kept is not None:
                slots.add_metric([slot], bytes_kept)
        yield slots
    levels = GaugeMetricFamily(
        f"{PREFIX}_health_level",
        "Each doctor check's level: 0 ok, 1 warning, 2 problem (a check that could not "
        "look is left out).",
        labels=["check"],
    )
    for finding in report.findings:
        if finding.level in LEVELS:
            levels.add_metric([finding.check], LEVELS.index(finding.level))
    yield levels


class Metrics:
    """The registry of one process and its text exposition.

    Parameters:
      monitor(Monitor): the monitoring reads.
      settle(float): see :class:`QueueCollector`.
    """

    def __init__(self, monitor: Monitor, *, settle: float = EVENT_SETTLE_SECONDS) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = QueueCollector(monitor, settle=settle)
        self.registry.register(self.collector)
        self.registry.register(HealthCollector(monitor))

    def render(self) -> bytes:
        """The metrics in Prometheus' text format (version 0.0.4)."""
        return generate_latest(self.registry)

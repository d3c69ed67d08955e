"""Where a job is, in the operator's words: one vocabulary for the CLI, the admin API, the
dashboard and the metrics.

A row's ``status`` is what the state machine stores: queued, running, succeeded, failed,
cancelled. An operator asks a finer question (why has this job not run yet?), whose answer
also depends on the clock and on the job's queue:

============= ==========================================================================
state         meaning
============= ==========================================================================
ready         queued, runnable now (its ``available_at`` has passed), its queue not paused
delayed       queued, not runnable before a later ``available_at`` (a delay, an eta, a
              retry's backoff)
paused        queued and runnable now, but an operator paused its queue
running       claimed by a worker whose lease is current
lease_expired claimed, but its lease ended: its worker died, hung or lost the database;
              it waits for a worker's reaper to take it back (or an operator's requeue,
              :meth:`~.operator.OperatorTransitions.requeue_expired`)
succeeded,    finished: the stored status
failed,
cancelled
============= ==========================================================================

A delayed job of a paused queue is ``delayed`` until its time comes, then ``paused``: the
first says when it may run, the second why it does not.

Each state is written here once, as data (:data:`STATES`): the stored status it is a part
of and what its ``available_at``, its lease and its queue's pause must be. Every reader
evaluates that data and nothing else: :func:`state_of` for one job, :func:`filter_params`
for a list's filter (the CLI's ``list_jobs`` statement; the admin API builds the same
conditions from the same fields), and :func:`queue_counts_of` for the per-queue counts,
whose statement (``count_by_queue``) only groups the rows by those facts.

The list filters also take ``queued``, the stored status (every waiting job: ready,
delayed and paused), which they took before the states existed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class JobState:
    """One state of the vocabulary: a stored status, narrowed by the facts that are None
    when they do not matter.

    Attributes:
      name(str): the state's name, as the API and ``--json`` write it.
      status(str): the stored status the state is a part of.
      label(str): how a person reads it (``lease expired``).
      description(str): one sentence: what it means for the job.
      due(bool): its ``available_at`` has passed (None: either).
      paused(bool): an operator paused its queue (None: either).
      lease_current(bool): its lease has not ended (None: either).
    """

    name: str
    status: str
    label: str
    description: str
    due: bool | None = None
    paused: bool | None = None
    lease_current: bool | None = None

    def matches(
        self, status: str, due: bool | None, paused: bool | None, lease_current: bool | None
    ) -> bool:
        """Whether a job with these facts is in this state."""
        return (
            status == self.status
            and (self.due is None or due == self.due)
            and (self.paused is None or bool(paused) == self.paused)
            and (self.lease_current is None or lease_current == self.lease_current)
        )


READY = "ready"
DELAYED = "delayed"
PAUSED = "paused"
RUNNING = "running"
LEASE_EXPIRED = "lease_expired"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

#: The vocabulary, in the order a job usually meets it (the order of every table and list
#: that shows the states).
STATES: dict[str, JobState] = {
    state.name: state
    for state in (
        JobState(
            READY,
            "queued",
            "ready",
            "waiting, runnable now: the next free worker thread of its queue takes it",
            due=True,
            paused=False,
        ),
        JobState(
            DELAYED,
            "queued",
            "delayed",
            "waiting for a later time (a delay, an eta or a retry's backoff)",
            due=False,
        ),
        JobState(
            PAUSED,
            "queued",
            "paused",
            "runnable, but an operator paused its queue: no worker claims it until resumed",
            due=True,
            paused=True,
        ),
        JobState(
            RUNNING,
            "running",
            "running",
            "claimed by a worker that keeps its lease",
            lease_current=True,
        ),
        JobState(
            LEASE_EXPIRED,
            "running",
            "lease expired",
            "waiting for a worker to take it back (or an operator's requeue): its worker "
            "stopped renewing its lease (it died, hung or lost the database)",
            lease_current=False,
        ),
        JobState(SUCCEEDED, "succeeded", "succeeded", "finished: its actor returned"),
        JobState(
            FAILED, "failed", "failed", "finished: failed for good (a dead letter) until retried"
        ),
        JobState(CANCELLED, "cancelled", "cancelled", "finished: cancelled, never to run"),
    )
}

#: The states of a job that has not finished, and of one that has.
UNFINISHED = (READY, DELAYED, PAUSED, RUNNING, LEASE_EXPIRED)
FINISHED = (SUCCEEDED, FAILED, CANCELLED)

#: The list filter that is a stored status, not a state: every waiting job (ready, delayed
#: and paused), as the status filter of earlier releases meant it.
QUEUED = "queued"
#: Every value a job list's filter takes: the states, and :data:`QUEUED`.
FILTERS = (*STATES, QUEUED)


def state_of(
    status: str,
    *,
    available_at: dt.datetime | None = None,
    locked_until: dt.datetime | None = None,
    paused: bool | None = False,
    now: dt.datetime,
) -> str:
    """The state of one job (see :data:`STATES`).

    Parameters:
      status(str): the row's stored status.
      available_at(datetime): the row's earliest claim time.
      locked_until(datetime): the row's lease end (a running row has one).
      paused(bool): whether an operator paused the job's queue.
      now(datetime): the clock to compare with (the server's, where the row was read).
    """
    due = available_at is None or available_at <= now
    lease_current = locked_until is not None and locked_until >= now
    return state_of_facts(status, due, paused, lease_current)


def state_of_facts(
    status: str, due: bool | None, paused: bool | None, lease_current: bool | None
) -> str:
    """The state of a job (or of a group of jobs) with these facts: the first state of
    :data:`STATES` they match; the stored status when none does."""
    for state in STATES.values():
        if state.matches(status, due, paused, lease_current):
            return state.name
    return status


def filter_params(name: str | None) -> dict[str, Any]:
    """The parameters of a list's state filter: ``status``, ``due``, ``paused`` and
    ``lease_current``, each None where it does not narrow (all None for no filter, only
    ``status`` for :data:`QUEUED`). A statement compares each given one with the row's
    fact (see ``operator.sql`` ``list_jobs``).

    Raises:
      ValueError: ``name`` is neither a state nor :data:`QUEUED`.
    """
    if name is None:
        return {"status": None, "due": None, "paused": None, "lease_current": None}
    if name == QUEUED:
        return {"status": QUEUED, "due": None, "paused": None, "lease_current": None}
    state = STATES.get(name)
    if state is None:
        raise ValueError(f"{name!r} is not a job state: one of {', '.join(FILTERS)}")
    return {
        "status": state.status,
        "due": state.due,
        "paused": state.paused,
        "lease_current": state.lease_current,
    }


@dataclasses.dataclass
class QueueCounts:
    """One queue's unfinished and failed jobs, by state (see
    :meth:`~.reads.Reads.queue_counts`).

    Attributes:
      ready, delayed, paused, running, lease_expired, failed(int): jobs in each state.
      oldest_waiting_seconds(float): how long the oldest runnable job (ready or paused) has
        been runnable (since its ``available_at``), by the server's clock; None when none is.
      next_delayed_at(datetime): when the earliest delayed job becomes runnable (None: no
        job is delayed).
    """

    ready: int = 0
    delayed: int = 0
    paused: int = 0
    running: int = 0
    lease_expired: int = 0
    failed: int = 0
    oldest_waiting_seconds: float | None = None
    next_delayed_at: dt.datetime | None = None

    def as_dict(self) -> dict[str, int]:
        """The counts by state (the ``jobs`` object of a queue in the API and ``--json``)."""
        return {name: getattr(self, name) for name in (*UNFINISHED, FAILED)}

    @property
    def waiting(self) -> int:
        """Jobs that wait (ready, delayed or paused)."""
        return self.ready + self.delayed + self.paused

    def add(self, other: QueueCounts) -> QueueCounts:
        """The counts of two queues added up (the metrics' undeclared queues)."""
        oldest = [s for s in (self.oldest_waiting_seconds, other.oldest_waiting_seconds) if s]
        nexts = [n for n in (self.next_delayed_at, other.next_delayed_at) if n is not None]
        return QueueCounts(
            **{name: getattr(self, name) + getattr(other, name) for name in self.as_dict()},
            oldest_waiting_seconds=max(oldest) if oldest else None,
            next_delayed_at=min(nexts) if nexts else None,
        )


def queue_counts_of(rows: Iterable[Sequence[Any]]) -> dict[str, QueueCounts]:
    """The rows of the ``count_by_queue`` statement (a queue, the facts of a group of its
    jobs, how many, the group's earliest ``available_at`` and the server's clock), as
    counts per queue, each group put in its state by :func:`state_of_facts`."""
    found: dict[str, QueueCounts] = {}
    for queue_name, status, due, paused, lease_current, n, first_at, now in rows:
        counts = found.setdefault(queue_name, QueueCounts())
        name = state_of_facts(status, due, paused, lease_current)
        setattr(counts, name, getattr(counts, name) + int(n))
        if status == QUEUED and first_at is not None:
            if due:
                waited = round(max(0.0, (now - first_at).total_seconds()), 3)
                counts.oldest_waiting_seconds = max(counts.oldest_waiting_seconds or 0.0, waited)
            elif counts.next_delayed_at is None or first_at < counts.next_delayed_at:
                counts.next_delayed_at = first_at
    return dict(sorted(found.items()))

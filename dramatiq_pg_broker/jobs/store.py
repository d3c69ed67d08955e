"""The job state machine: one method per transition, all SQL behind it.

The broker, the consumer, the heartbeat, the reaper and the admin API all change jobs only
through :class:`JobStore`. Transitions out of ``running`` take :class:`Attempt` references
(job id, lease owner, attempt number) and return the ids they changed: an id missing from
the result means the caller no longer owns that attempt (its lease expired and another
worker claimed the job), never an exception.

::

    queued  -> running      claim
    running -> succeeded    complete
    running -> running      start (the claimed message's actor is about to run)
    running -> queued       reschedule (retry), reap (lease expired), release (shutdown),
                            requeue_expired (operator: the reap of chosen expired leases)
    running -> failed       fail, or reap with interruptions exhausted
    failed  -> queued       retry_failed (operator)
    queued  -> cancelled    cancel (operator), abort (operator)
    running -> running      abort (operator): the attempt is marked, its worker stops it
    running -> cancelled    abort_attempts (the worker stopped an aborted attempt), or
                            reschedule / reap of an attempt whose abort was requested
"""

from __future__ import annotations

from .claims import Claims
from .lanes import Lanes
from .operator import OperatorTransitions
from .outcomes import Outcomes
from .reads import Reads
from .sends import SendWrites
from .statistics import Statistics


class JobStore(SendWrites, Claims, Outcomes, OperatorTransitions, Reads, Statistics, Lanes):
    """The job-store API over one schema.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the schema of the job tables.
      events(bool): write job events (the audit trail). Operator actions always write
        theirs.

    Every method accepts ``conn=`` to run on a connection the caller holds (for example
    inside the application's own transaction) instead of the pool, and ``now=`` to inject a
    clock in tests.
    """

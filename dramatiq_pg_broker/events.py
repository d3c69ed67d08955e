"""Job event types: the append-only timeline that explains how a job reached its state.

Events are written by the same statement as the transition they record (see
``sql/queries.sql``), so the job row and its events never disagree. The job row is the
truth; events explain it.
"""

from __future__ import annotations

#: A message was stored as a queued job.
CREATED = "created"
#: A worker claimed the job: a new attempt started (``attempt`` is its number).
CLAIMED = "claimed"
#: A running actor reported progress (``data`` is what it reported); renews the lease.
PROGRESS = "progress"
#: A running actor explicitly renewed its lease (the background heartbeat writes none).
LEASE_RENEWED = "lease_renewed"
#: The attempt succeeded (``data.in_transaction``: in the actor's own transaction, see
#: ``current_job().complete_in()``).
SUCCEEDED = "succeeded"
#: The attempt failed and the job will run again after a backoff (``data.error``,
#: ``data.delay_ms``, ``data.available_at``).
RETRY_SCHEDULED = "retry_scheduled"
#: The job failed for good: rejected, retries exhausted, or its last lease expired.
FAILED = "failed"
#: The attempt's lease expired (its worker died or hung); the job was requeued.
TIMEOUT_REQUEUED = "timeout_requeued"
#: A claimed message that never started went back to the queue at worker shutdown; its
#: attempt was not charged.
RELEASED = "released"
#: An operator moved a failed job back to the queue; attempts start again from zero.
MANUAL_RETRY = "manual_retry"
#: An operator cancelled a queued job.
CANCELLED = "cancelled"
#: An operator asked for a running job to be aborted (``actor`` is who asked); its worker
#: stops the attempt within about a second.
ABORT_REQUESTED = "abort_requested"
#: A job ended ``cancelled`` because of an abort (``actor`` is who asked): at once for a
#: waiting job, when its worker stopped the attempt (``data.worker``) for a running one.
ABORTED = "aborted"

#: Every event type, in the order a job usually meets them.
ALL = (
    CREATED,
    CLAIMED,
    PROGRESS,
    LEASE_RENEWED,
    SUCCEEDED,
    RETRY_SCHEDULED,
    FAILED,
    TIMEOUT_REQUEUED,
    RELEASED,
    MANUAL_RETRY,
    CANCELLED,
    ABORT_REQUESTED,
    ABORTED,
)

#: Job statuses; the terminal ones end a job's life until an operator retries it.
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")

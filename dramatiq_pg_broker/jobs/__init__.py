"""The job store: one method per transition of a job row, split by role."""

from .rows import (
    LEASE_EXPIRED,
    MIN_ID_PREFIX,
    PAUSE_PAYLOAD,
    SEND_FIELDS,
    Attempt,
    Claim,
    ClaimedJob,
    EnqueueResult,
    NewJob,
    ReapResult,
    Renewal,
    abort_payload,
    channel_name,
    id_prefix_range,
    send_values,
)
from .states import STATES, JobState, QueueCounts, queue_counts_of, state_of
from .store import JobStore

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
    QueueCounts,
    ReapResult,
    Renewal,
    abort_payload,
    channel_name,
    id_prefix_range,
    queue_counts_of,
    send_values,
)
from .store import JobStore

"""WorkerCore: the four collaborators the worker side of a broker claims, holds and renews
attempts with.

The lease keeper (heartbeat and reaper) and every consumer use exactly these four: the
job store (claims, renewals, the reaper's statement), the settings (the lease, the
intervals), the in-flight ledger (the attempts this process holds) and the schema gate
(nothing is claimed, renewed or reaped before the schema handshake passed). The broker
builds the record once and hands the same one to both, so that each is built with what it
uses without the broker listing the four again for each.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Settings
    from ..db.handshake import SchemaGate
    from ..jobs.store import JobStore
    from .inflight import Ledger


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerCore:
    """What the lease keeper and every consumer of a broker share (see the module
    docstring)."""

    #: The job store: claims, renewals, the reaper's statement, dead letters.
    store: JobStore
    #: The broker's settings.
    settings: Settings
    #: The in-flight ledger: every attempt this process claimed, until its outcome.
    ledger: Ledger
    #: The schema handshake's gate: nothing is claimed, renewed or reaped before it opens.
    schema_gate: SchemaGate

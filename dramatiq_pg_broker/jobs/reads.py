"""Reads of jobs: one job, an id prefix, its events, queue counts."""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..errors import AmbiguousJobId, JobNotFound
from .base import StoreBase
from .rows import MAX_ID_CANDIDATES, id_prefix_range
from .states import QueueCounts, queue_counts_of


class Reads(StoreBase):
    """Reads (a part of :class:`~.store.JobStore`)."""

    # -- reads -------------------------------------------------------------------------

    def get(self, job_id: str, *, conn=None) -> dict[str, Any]:
        """One job as a dict of its columns.

        Raises:
          JobNotFound: no job has this id.
        """
        with self.pool.use(conn) as c:
            cur = c.execute(self.queries["get_job"], {"id": job_id})
            row = cur.fetchone()
            if row is None:
                raise JobNotFound(f"no job with id {job_id}")
            return dict(zip([d.name for d in cur.description], row))

    def resolve_id(self, text: str, *, conn=None) -> str:
        """The id of the one job whose id is ``text`` or starts with it.

        A whole UUID (any form :class:`uuid.UUID` reads) is returned as it is, without a
        look-up. A prefix needs at least :data:`MIN_ID_PREFIX` hex characters (hyphens are
        ignored), such as the 8 characters the demo and ``jobs list`` show; it is resolved
        with one range scan of the primary key.

        Parameters:
          text(str): a job id, or its first characters.

        Raises:
          InvalidJobId: ``text`` is not hex, or is shorter than the minimum prefix.
          JobNotFound: no job id starts with it.
          AmbiguousJobId: several do; the error lists them.

        Returns:
          str: the job's id, in the canonical form.
        """
        bounds = id_prefix_range(text)
        if isinstance(bounds, str):
            return bounds
        low, high = bounds
        with self.pool.use(conn) as c:
            cur = c.execute(
                self.queries["find_job_ids"],
                {"low": low, "high": high, "limit": MAX_ID_CANDIDATES + 1},
            )
            names = [d.name for d in cur.description]
            rows = [dict(zip(names, row)) for row in cur.fetchall()]
        if not rows:
            raise JobNotFound(f"no job id starts with {text.strip()!r}")
        if len(rows) > 1:
            for row in rows:
                row["id"] = str(row["id"])
            more = len(rows) > MAX_ID_CANDIDATES
            raise AmbiguousJobId(text.strip(), rows[:MAX_ID_CANDIDATES], more)
        return str(rows[0]["id"])

    def events_of(self, job_id: str, *, conn=None) -> list[dict[str, Any]]:
        """A job's events, oldest first."""
        with self.pool.use(conn) as c:
            cur = c.execute(self.queries["get_job_events"], {"id": job_id})
            names = [d.name for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def count_unfinished(self, queue_name: str, *, conn=None) -> int:
        """Jobs of a queue still waiting (delayed included) or running."""
        return self._fetch("count_unfinished", {"queue_name": queue_name}, conn)[0][0]

    def count_failed_since(self, queue_name: str, since: dt.datetime, *, conn=None) -> int:
        return self._fetch("count_failed_since", {"queue_name": queue_name, "since": since}, conn)[
            0
        ][0]

    def queue_counts(self, *, conn=None, now=None, failed: bool = True) -> dict[str, QueueCounts]:
        """Per queue, its jobs in each unfinished state and its failed jobs (see
        :mod:`.states`), how long the oldest runnable one has waited and when the next
        delayed one becomes runnable: the one count the CLI's ``stats``, the admin API and
        its metrics all show. It reads the partial indexes on waiting and running rows and
        the failed partitions of history (not with ``failed`` False), never the finished
        rows of a big table, so it costs what the backlog costs. A queue with no
        unfinished or failed job does not appear."""
        params = {"now": now, "failed": failed}
        return queue_counts_of(self._fetch("count_by_queue", params, conn))

    def flush(self, queue_name: str, *, conn=None) -> int:
        """Delete the waiting and running jobs of a queue; returns how many."""
        with self.pool.use(conn) as c:
            return c.execute(self.queries["flush_queue"], {"queue_name": queue_name}).fetchone()[0]

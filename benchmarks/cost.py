"""What jobs cost the PostgreSQL server: WAL bytes and CPU time, measured around a phase.

WAL, two ways:

- the raw delta of ``pg_current_wal_insert_lsn()`` from the phase's start to its end: every
  byte the server wrote in between, whoever wrote it, so on a shared server other sessions'
  work counts too;
- the records themselves, read back with the ``pg_walinspect`` extension (PostgreSQL 15+,
  ``pg_get_wal_records_info``): a record counts when a block it references belongs to the
  benchmark's database, and so does a record without a block (a ``COMMIT``) of a
  transaction that wrote such a block. Each record's length is rounded up to the 8-byte
  boundary its next record starts at, so the sum of a quiet server's records is its LSN
  delta less the WAL page headers. These records are grouped by relation (a partition
  under its partitioned table, an index under its own name, TOAST under its table) and by
  record type (``Heap/INSERT``, ``Transaction/COMMIT``...), with the full-page images apart.
  This filtered sum is what makes a figure per job trustworthy on a shared server.

The extension is created when the benchmark's role may (a superuser) and dropped at the
end if the benchmark created it; without it the totals are still reported, with the reason.
A server busy with other work may recycle a phase's WAL segments before they are read back
(a checkpoint removes them): from a phase's start until its records are read, a temporary
physical replication slot (``pg_create_physical_replication_slot(..., temporary => true)``,
gone with its session, which the meter closes once the records are read) keeps them.

CPU, two ways, from the server's processes (``psutil``: the server must run on this machine):

- all server processes: the postmaster, its live children (backends, WAL writer,
  checkpointer...) and the children it has already reaped (the kernel adds a child's time
  to its parent's when it exits). Exact on a server of the benchmark's own (the embedded
  one); on a shared server every other session's work counts too;
- this database's backends: the processes whose title names the benchmark's database,
  sampled every :data:`SAMPLE_S` seconds (a backend that exits between two samples loses
  at most that much of its time). Background processes (WAL writer, checkpointer) are not
  in it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass, field

import psycopg

WALINSPECT = "pg_walinspect"
#: A breakdown reads the phase's WAL back; past this many bytes (a shared server busy with
#: other work) it would take too long and is not made.
MAX_INSPECT_BYTES = 512 * 2**20
#: Seconds between two samples of this database's backends' CPU time.
SAMPLE_S = 0.02
#: Seconds between two looks for new backends of this database.
RESCAN_S = 0.25
#: A backend's process title: ``postgres: [cluster: ]user database host activity``.
TITLE_RE = re.compile(r"^postgres: (?:\S+: )?\S+ (\S+) ")
#: Records without a relation (commits, among others) are grouped under this name.
NO_RELATION = "(no relation: commits and the like)"
_slots = itertools.count(1)


def prepare(url: str) -> tuple[str | None, bool]:
    """Make ``pg_walinspect`` usable in the database of ``url``.

    Returns ``(reason, created)``: ``reason`` is ``None`` when the extension works, else
    why the breakdown is missing; ``created`` says whether this call created it (so that
    :func:`cleanup` drops it again)."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            created = False
            if not conn.execute(
                "SELECT 1 FROM pg_extension WHERE extname = %s", (WALINSPECT,)
            ).fetchone():
                if int(conn.info.server_version) < 150000:
                    return "pg_walinspect needs PostgreSQL 15 or later", False
                try:
                    conn.execute(f"CREATE EXTENSION {WALINSPECT}")
                except psycopg.Error as e:
                    return f"CREATE EXTENSION {WALINSPECT} failed: {_first_line(e)}", False
                created = True
            if not conn.execute(
                "SELECT has_function_privilege("
                "'pg_get_wal_records_info(pg_lsn, pg_lsn)', 'EXECUTE')"
            ).fetchone()[0]:
                return (
                    "this role may not run pg_get_wal_records_info (a superuser or a member "
                    "of pg_read_server_files may)",
                    created,
                )
            return None, created
    except psycopg.Error as e:
        return f"{type(e).__name__}: {_first_line(e)}", False


def cleanup(url: str, created: bool) -> None:
    """Drop the extension again when :func:`prepare` created it."""
    if not created:
        return
    with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP EXTENSION IF EXISTS {WALINSPECT}")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# -- CPU ----------------------------------------------------------------------------------


class ServerCPU:
    """The CPU time of a local server's processes (see the module docstring)."""

    def __init__(self, url: str) -> None:
        import psutil

        self.psutil = psutil
        with psycopg.connect(url, autocommit=True) as conn:
            pid, self.database, datadir = conn.execute(
                "SELECT pg_backend_pid(), current_database(), current_setting('data_directory')"
            ).fetchone()
        try:
            postmaster = psutil.Process(pid).parent()
        except psutil.Error as e:
            raise RuntimeError(f"the server's processes are not on this machine ({e})") from None
        if postmaster is None or "postgres" not in " ".join(_cmdline(postmaster)):
            raise RuntimeError("the server's processes are not on this machine")
        with contextlib.suppress(psutil.Error):
            # The same pid on another machine's server would be a coincidence; say so.
            if os.path.realpath(postmaster.cwd()) != os.path.realpath(datadir):
                raise RuntimeError("the process found is not this server's postmaster")
        self.postmaster = postmaster

    def total(self) -> float:
        """Seconds of CPU of the postmaster and all its children, live and reaped."""
        total = 0.0
        for child in self.postmaster.children():
            with contextlib.suppress(self.psutil.Error):
                t = child.cpu_times()
                total += t.user + t.system
        t = self.postmaster.cpu_times()
        return total + t.user + t.system + t.children_user + t.children_system

    def backends(self) -> dict[int, tuple[object, float]]:
        """This database's backends now: pid -> (process, CPU seconds)."""
        found = {}
        for child in self.postmaster.children():
            with contextlib.suppress(self.psutil.Error):
                m = TITLE_RE.match(" ".join(_cmdline(child)))
                if m and m.group(1) == self.database:
                    t = child.cpu_times()
                    found[child.pid] = (child, t.user + t.system)
        return found


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except Exception:
        return []


class _BackendSampler(threading.Thread):
    """Follows the CPU time of this database's backends while a phase runs."""

    def __init__(self, cpu: ServerCPU) -> None:
        super().__init__(daemon=True, name="bench-cpu-sampler")
        self.cpu = cpu
        start = cpu.backends()
        #: pid -> CPU seconds at the start (a backend born later started from 0).
        self.baseline = {pid: seconds for pid, (_, seconds) in start.items()}
        self.processes = {pid: process for pid, (process, _) in start.items()}
        self.last = dict(self.baseline)
        self.halt = threading.Event()
        self.error: str | None = None

    def _sample(self) -> None:
        for pid, process in list(self.processes.items()):
            try:
                t = process.cpu_times()
            except self.cpu.psutil.Error:
                del self.processes[pid]  # gone: its last sample stands
                continue
            self.last[pid] = t.user + t.system

    def _rescan(self) -> None:
        for pid, (process, seconds) in self.cpu.backends().items():
            if pid not in self.last:
                self.processes[pid] = process
                self.last[pid] = seconds

    def run(self) -> None:
        try:
            rescanned = time.monotonic()
            while not self.halt.wait(SAMPLE_S):
                self._sample()
                if time.monotonic() - rescanned >= RESCAN_S:
                    self._rescan()
                    rescanned = time.monotonic()
        except Exception as e:  # reported with the figures
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> float:
        """Stop sampling; the CPU seconds this database's backends spent meanwhile."""
        self.halt.set()
        self.join(5)
        self._rescan()
        self._sample()
        return sum(seconds - self.baseline.get(pid, 0.0) for pid, seconds in self.last.items())


# -- a phase ------------------------------------------------------------------------------


@dataclass
class Phase:
    """What the server did between :meth:`Meter.start` and :meth:`Meter.stop`."""

    start_lsn: str
    end_lsn: str
    raw_bytes: int
    seconds: float
    cpu_s: float | None = None
    db_cpu_s: float | None = None
    cpu_error: str | None = None
    #: Filled by :func:`inspect`: bytes of this database's records, full-page images among
    #: them, and both grouped by relation and by record type.
    ours_bytes: int | None = None
    fpi_bytes: int | None = None
    records: int | None = None
    by_relation: dict[str, int] = field(default_factory=dict)
    by_record: dict[str, int] = field(default_factory=dict)
    by_relation_nofpi: dict[str, int] = field(default_factory=dict)
    inspect_error: str | None = None
    #: The session whose temporary slot keeps the phase's WAL until it is read back.
    hold: psycopg.Connection | None = field(default=None, repr=False)

    def release(self) -> None:
        """Let the server recycle the phase's WAL (close the slot's session)."""
        if self.hold is not None:
            with contextlib.suppress(psycopg.Error):
                self.hold.close()
            self.hold = None


class Meter:
    """Measures one phase on the server of ``url``: ``start()``, the work, ``stop()``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection | None = None

    def start(self) -> Meter:
        self.cpu_error = None
        self.cpu: ServerCPU | None = None
        self.sampler: _BackendSampler | None = None
        try:
            self.cpu = ServerCPU(self.url)
        except Exception as e:
            self.cpu_error = str(e)
        # Opened before the LSN is read, so that its own start is outside the phase.
        self.conn = psycopg.connect(self.url, autocommit=True)
        try:
            # Keeps the WAL from here on until the phase's records are read (see the
            # module docstring); it writes no WAL itself.
            self.conn.execute(
                "SELECT pg_create_physical_replication_slot(%s, true, true)",
                (f"bench_wal_{os.getpid()}_{next(_slots)}",),
            )
        except psycopg.Error:
            pass  # no replication privilege: the WAL is read back if still there
        if self.cpu is not None:
            self.sampler = _BackendSampler(self.cpu)
            self.cpu_before = self.cpu.total()
            self.sampler.start()
        self.lsn_before = self._lsn()
        self.started = time.monotonic()
        return self

    def _lsn(self) -> str:
        assert self.conn is not None
        return str(self.conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0])

    def stop(self) -> Phase:
        assert self.conn is not None
        lsn_after = self._lsn()
        seconds = time.monotonic() - self.started
        cpu_s = db_cpu_s = None
        if self.cpu is not None and self.sampler is not None:
            cpu_s = self.cpu.total() - self.cpu_before
            db_cpu_s = self.sampler.stop()
            if self.sampler.error:
                self.cpu_error, db_cpu_s = self.sampler.error, None
        raw = self.conn.execute(
            "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (lsn_after, self.lsn_before)
        ).fetchone()[0]
        return Phase(self.lsn_before, lsn_after, int(raw), seconds, cpu_s, db_cpu_s,
                     self.cpu_error, hold=self.conn)  # fmt: skip


# -- reading the WAL back -----------------------------------------------------------------

# One row per relation file of this database written in the range (``rel`` the
# relfilenode), one per record type, and the totals; this database's records only (see the
# module docstring). The length of a record is rounded up to 8 bytes, as it lies in the WAL.
_INSPECT = """
WITH r AS (
    SELECT xid::text::bigint AS xid, resource_manager || '/' || record_type AS kind,
           (record_length + 7) / 8 * 8 AS bytes, fpi_length AS fpi,
           regexp_match(block_ref, 'rel (\\d+)/(\\d+)/(\\d+)') AS m
    FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)
),
x AS (
    SELECT DISTINCT xid FROM r WHERE m[2]::oid = %(db)s::oid AND xid <> 0
),
ours AS (
    SELECT r.kind, r.bytes, r.fpi, r.m[1]::oid AS spc, r.m[3]::oid AS rel FROM r
    WHERE r.m[2]::oid = %(db)s::oid OR (r.m IS NULL AND r.xid IN (SELECT xid FROM x))
)
SELECT 'rel', spc::text, rel::text, sum(bytes)::bigint, sum(fpi)::bigint, count(*)
FROM ours GROUP BY spc, rel
UNION ALL
SELECT 'kind', kind, NULL, sum(bytes)::bigint, sum(fpi)::bigint, count(*)
FROM ours GROUP BY kind
"""

# The group a relation file belongs to: a table (its partitions' under the partitioned
# table), ``index <name>`` under the root index, ``toast`` under its table.
_GROUP = """
WITH c AS (
    SELECT c.oid, c.relkind, c.relname, n.nspname
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = pg_filenode_relation(%(spc)s, %(rel)s)
),
owner AS (
    SELECT coalesce(
        (SELECT t.oid FROM pg_class AS t WHERE t.reltoastrelid = c.oid),
        (SELECT t.oid FROM pg_index AS i JOIN pg_class AS tt ON tt.oid = i.indrelid
             JOIN pg_class AS t ON t.reltoastrelid = tt.oid WHERE i.indexrelid = c.oid),
        (SELECT i.indrelid FROM pg_index AS i WHERE i.indexrelid = c.oid),
        (SELECT d.refobjid FROM pg_depend AS d WHERE d.objid = c.oid
             AND d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
             AND d.deptype IN ('a', 'i') LIMIT 1),
        c.oid) AS oid,
        c.relkind, c.oid AS self,
        EXISTS (SELECT 1 FROM pg_class AS t WHERE t.reltoastrelid = c.oid)
        OR EXISTS (SELECT 1 FROM pg_index AS i JOIN pg_class AS t ON t.reltoastrelid = i.indrelid
                   WHERE i.indexrelid = c.oid) AS toast
    FROM c
)
SELECT (SELECT relname FROM pg_class WHERE oid = coalesce(pg_partition_root(owner.oid), owner.oid)),
       CASE WHEN owner.toast THEN 'toast'
            WHEN owner.relkind IN ('i', 'I') THEN 'index ' || (SELECT relname FROM pg_class
                 WHERE oid = coalesce(pg_partition_root(owner.self), owner.self))
            WHEN owner.relkind = 'S' THEN 'sequence'
            ELSE 'heap' END
FROM owner
"""


def inspect(url: str, phase: Phase) -> None:
    """Read the phase's WAL back (``pg_walinspect``) and fill in this database's records,
    by relation and by record type (see the module docstring); on failure, say why in
    ``phase.inspect_error``. Call it before the relations change their files (a
    ``TRUNCATE``), since relation files are named by their current relfilenode. The
    phase's WAL is released afterwards."""
    try:
        _inspect(url, phase)
    finally:
        phase.release()


def _inspect(url: str, phase: Phase) -> None:
    if phase.raw_bytes > MAX_INSPECT_BYTES:
        phase.inspect_error = (
            f"not read back: {phase.raw_bytes / 2**20:.0f} MiB of WAL in the phase, more than "
            f"{MAX_INSPECT_BYTES / 2**20:.0f} MiB (other sessions' work)"
        )
        return
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            # Records can only be read once they are flushed.
            deadline = time.monotonic() + 10
            while conn.execute(
                "SELECT pg_current_wal_flush_lsn() < %s::pg_lsn", (phase.end_lsn,)
            ).fetchone()[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the WAL was not flushed within 10 s")
                time.sleep(0.05)
            db, default_spc = conn.execute(
                "SELECT d.oid, d.dattablespace FROM pg_database AS d "
                "WHERE d.datname = current_database()"
            ).fetchone()
            rows = conn.execute(
                _INSPECT, {"start": phase.start_lsn, "end": phase.end_lsn, "db": db}
            ).fetchall()
            by_relation: dict[str, int] = {}
            by_relation_nofpi: dict[str, int] = {}
            by_record: dict[str, int] = {}
            total = fpi = records = 0
            names: dict[tuple[int, int], str] = {}
            for what, a, b, size, image, n in rows:
                if what == "kind":
                    by_record[a] = by_record.get(a, 0) + size
                    total += size
                    fpi += image
                    records += n
                    continue
                name = NO_RELATION
                if a is not None:
                    spc, rel = int(a), int(b)
                    key = (spc, rel)
                    if key not in names:
                        found = conn.execute(
                            _GROUP, {"spc": 0 if spc == default_spc else spc, "rel": rel}
                        ).fetchone()
                        names[key] = f"{found[0]} {found[1]}" if found else "(a dropped relation)"
                    name = names[key]
                by_relation[name] = by_relation.get(name, 0) + size
                by_relation_nofpi[name] = by_relation_nofpi.get(name, 0) + size - image
    except Exception as e:
        phase.inspect_error = f"{type(e).__name__}: {_first_line(e)}"
        return
    phase.ours_bytes, phase.fpi_bytes, phase.records = total, fpi, records
    phase.by_relation, phase.by_record = by_relation, by_record
    phase.by_relation_nofpi = by_relation_nofpi


def figures(count: int, send: Phase, drain: Phase) -> dict:
    """The figures per job of a job's whole life (a send phase and a drain phase), as the
    results store them: bytes and microseconds per job, the breakdowns under ``rel:`` and
    ``rec:`` keys (whole life, bytes per job)."""
    out: dict[str, float] = {
        "wal_raw_b": (send.raw_bytes + drain.raw_bytes) / count,
        "wal_send_raw_b": send.raw_bytes / count,
        "wal_drain_raw_b": drain.raw_bytes / count,
        "send_s": send.seconds,
        "drain_s": drain.seconds,
    }
    if send.ours_bytes is not None and drain.ours_bytes is not None:
        out.update(
            wal_b=(send.ours_bytes + drain.ours_bytes) / count,
            wal_send_b=send.ours_bytes / count,
            wal_drain_b=drain.ours_bytes / count,
            wal_fpi_b=((send.fpi_bytes or 0) + (drain.fpi_bytes or 0)) / count,
            # Full-page images depend on when the last checkpoint was: apart, the rest
            # compares across rounds and runs.
            wal_nofpi_b=(
                send.ours_bytes + drain.ours_bytes - (send.fpi_bytes or 0) - (drain.fpi_bytes or 0)
            )
            / count,  # fmt: skip
            wal_records=((send.records or 0) + (drain.records or 0)) / count,
        )
        for prefix, a, b in (
            ("rel:", send.by_relation, drain.by_relation),
            ("rec:", send.by_record, drain.by_record),
            # By relation without full-page images: compares across runs on a server
            # whose checkpoints come at any moment (other sessions' WAL).
            ("relnofpi:", send.by_relation_nofpi, drain.by_relation_nofpi),
        ):
            for name in sorted(set(a) | set(b)):
                out[prefix + name] = (a.get(name, 0) + b.get(name, 0)) / count
    if send.cpu_s is not None and drain.cpu_s is not None:
        out["cpu_us"] = (send.cpu_s + drain.cpu_s) / count * 1e6
    if send.db_cpu_s is not None and drain.db_cpu_s is not None:
        out.update(
            cpu_db_us=(send.db_cpu_s + drain.db_cpu_s) / count * 1e6,
            cpu_db_send_us=send.db_cpu_s / count * 1e6,
            cpu_db_drain_us=drain.db_cpu_s / count * 1e6,
        )
    return out


def notes(send: Phase, drain: Phase) -> list[str]:
    """Why a figure is missing, if one is."""
    out = []
    for phase in (send, drain):
        for note in (phase.inspect_error, phase.cpu_error):
            if note and note not in out:
                out.append(note)
    return out

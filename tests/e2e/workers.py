"""Real ``dramatiq`` worker processes for the e2e tests, and bounded waiting."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .. import helpers
from ..rows import status_of

REPO = Path(__file__).resolve().parents[2]

#: Short leases and quick maintenance, so crash recovery takes seconds.
FAST_SETTINGS = {
    "DRAMATIQ_PG_LEASE_SECONDS": "2",
    "DRAMATIQ_PG_REAPER_INTERVAL": "0.5",
    "DRAMATIQ_PG_BACKOFF_BASE_MS": "100",
    "DRAMATIQ_PG_POLL_INTERVAL": "0.2",
}


#: The beginnings of the three lines a process logs about a database outage
#: (:mod:`dramatiq_pg_broker.db.outage`).
OUTAGE_STARTS = "The database is unreachable"
OUTAGE_GOES_ON = "The database is still unreachable"
OUTAGE_ENDS = "The database is reachable again"

_LOG_LINE = re.compile(
    r"^\[(?P<at>[\d-]+ [\d:,]+)\] \[PID (?P<pid>\d+)\] \[(?P<thread>[^]]*)\] "
    r"\[(?P<logger>[^]]*)\] \[(?P<level>[A-Z]+)\] (?P<message>.*)$"
)


@dataclasses.dataclass(frozen=True, order=True)
class LogLine:
    """One record of a ``dramatiq`` process's log (its first line)."""

    at: dt.datetime
    pid: int
    logger: str
    level: str
    message: str

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S.%f} [{self.pid}] {self.logger} {self.level} {self.message}"


def log_records(path: Path, *, min_level: str = "WARNING") -> list[LogLine]:
    """The records of a ``dramatiq`` log file at ``min_level`` or above."""
    floor = logging.getLevelName(min_level)
    records = []
    for line in path.read_text(errors="replace").splitlines():
        match = _LOG_LINE.match(line)
        if match is None or logging.getLevelName(match["level"]) < floor:
            continue
        records.append(
            LogLine(
                at=dt.datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f"),
                pid=int(match["pid"]),
                logger=match["logger"],
                level=match["level"],
                message=match["message"],
            )
        )
    return records


#: Warnings about what an outage or a crash did to particular jobs (told once per event,
#: not per retry): a claim whose reply was lost is given back by the reaper, an outcome
#: finds its job no longer running when written again.
JOB_CONSEQUENCES = ("Reaper:", "Lost job")


@dataclasses.dataclass
class OutageStory:
    """A process log's warnings, sorted: the outage lines, and everything else."""

    starts: list[LogLine]
    reminders: list[LogLine]
    ends: list[LogLine]
    #: Warnings about particular jobs (:data:`JOB_CONSEQUENCES`).
    jobs: list[LogLine]
    others: list[LogLine]

    def __str__(self) -> str:
        lines = sorted(self.starts + self.reminders + self.ends + self.jobs + self.others)
        return "\n".join(str(line)[:300] for line in lines[:30])


def outage_story(path: Path) -> OutageStory:
    """Sort the warnings (and worse) of a ``dramatiq`` log file."""
    story = OutageStory([], [], [], [], [])
    for record in log_records(path):
        if record.message.startswith(OUTAGE_STARTS):
            story.starts.append(record)
        elif record.message.startswith(OUTAGE_GOES_ON):
            story.reminders.append(record)
        elif record.message.startswith(OUTAGE_ENDS):
            story.ends.append(record)
        elif record.message.startswith(JOB_CONSEQUENCES):
            story.jobs.append(record)
        else:
            story.others.append(record)
    return story


def outage_seconds(line: LogLine) -> float:
    """The length an outage's last line reports (``... unreachable for 4.2s.``)."""
    match = re.search(r"unreachable for (?:(\d+)h)?(?:(\d+)m)?([\d.]+)?s?\.$", line.message)
    assert match is not None, f"no outage length in: {line}"
    hours, minutes, seconds = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)


def wait_for(predicate, timeout: float, what: str, *, on_timeout=None):
    """:func:`tests.helpers.wait_for`, looking every 0.05 s (these predicates read logs or
    open connections)."""
    return helpers.wait_for(predicate, timeout, what, on_timeout=on_timeout, interval=0.05)


def wait_until_run(broker, worker: WorkerProcess, job_id: str) -> None:
    """Wait (30 s at most) for ``worker`` to run job ``job_id`` to success; on a timeout, say
    the job's status and show the worker's log."""
    wait_for(
        lambda: status_of(broker.store, job_id) == "succeeded",
        30,
        f"the worker to run job {job_id}",
        on_timeout=lambda: f"status: {status_of(broker.store, job_id)}\n{worker.log_tail()}",
    )


class WorkerProcess:
    """``python -m dramatiq <app> --processes P --threads N`` in its own process group, with
    its output in a log file. ``app`` defaults to ``tests.e2e.worker_app``, P to 1;
    ``python`` (another environment's interpreter) to this one, ``cwd`` to the checkout;
    ``options`` are more of the ``dramatiq`` command's options. ``command`` replaces the
    whole command line (``manage.py rundramatiq ...``, say)."""

    def __init__(
        self,
        url: str,
        schema: str,
        log_path: Path,
        *,
        threads: int = 2,
        app: str = "tests.e2e.worker_app",
        processes: int = 1,
        python: str | Path = sys.executable,
        cwd: Path = REPO,
        options: tuple[str, ...] = (),
        command: list[str] | None = None,
        **env,
    ):
        self.log_path = log_path
        #: How many worker processes it starts (one with ``command``).
        self.processes = 1 if command else processes
        environ = dict(os.environ)
        environ.update(FAST_SETTINGS)
        environ.update({"DRAMATIQ_PG_URL": url, "DRAMATIQ_PG_SCHEMA": schema})
        environ.update(env)
        environ["PYTHONUNBUFFERED"] = "1"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command
            or [
                str(python),
                "-m",
                "dramatiq",
                app,
                "--processes",
                str(processes),
                "--threads",
                str(threads),
                *options,
            ],
            cwd=cwd,
            env=environ,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "worker log (last lines):\n" + "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = 60, what: str = "the worker to start") -> None:
        """Wait until every one of its processes logged that it is ready for action."""
        wait_for(
            lambda: (
                self.log_path.read_text(errors="replace").count("ready for action")
                >= self.processes
            ),
            timeout,
            what,
            on_timeout=self.log_tail,
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within {timeout}s\n{self.log_tail()}")

    def kill_group(self) -> None:
        """SIGKILL everything this worker started (its process group, which outlives the
        main process if only that one died)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def worker_starter(pg_url: str, schema: str, tmp_path: Path):
    """For a fixture: yields ``start(**kwargs)`` that starts a :class:`WorkerProcess`;
    whatever is still running afterwards is killed."""
    started: list[WorkerProcess] = []

    def start(**kwargs) -> WorkerProcess:
        worker = WorkerProcess(pg_url, schema, tmp_path / f"worker{len(started)}.log", **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill_group()

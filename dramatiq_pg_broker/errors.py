"""The package's errors: one base class, each subclass's docstring is its meaning.

One exception stands apart: :class:`JobAborted` is raised inside a running actor, so it
derives from Dramatiq's ``Interrupt`` (a ``BaseException``, like ``TimeLimitExceeded``),
not from :class:`PgBrokerError`: an actor's ``except Exception`` must not swallow it.
"""

from __future__ import annotations

from dramatiq.middleware.threading import Interrupt


class PgBrokerError(Exception):
    """Base class of every error raised by dramatiq_pg_broker."""


class ConfigurationError(PgBrokerError):
    """A setting is missing or has a value that cannot be used."""


class InvalidDatabaseURL(ConfigurationError, ValueError):
    """The database URL is not one PostgreSQL's client library can use: refused when the
    settings are read (the broker is built, the CLI starts), never reported later as an
    outage."""


class MigrationError(PgBrokerError):
    """The database schema cannot be brought up to date."""


class MigrationChecksumError(MigrationError):
    """An applied migration file was edited after it was released."""


class LiveWorkFound(MigrationError):
    """A breaking migration was not applied: the database shows live work (leases, sends,
    claims) of processes that cannot check the schema. Stop them first, or force it."""


class SchemaMissing(PgBrokerError):
    """The broker's tables do not exist in this database and schema: run
    ``dramatiq-pg-broker migrate`` (with the same DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA)."""


class SchemaVersionError(PgBrokerError):
    """This code and the database's schema do not fit together: the schema lacks migrations
    this code needs, or requires a newer release of the package (see
    :mod:`dramatiq_pg_broker.db.handshake`)."""


class MigrationsPending(SchemaVersionError, SchemaMissing):
    """The database's schema is older than this code: migrations it needs are not applied.
    Run ``dramatiq-pg-broker migrate`` (with the same DRAMATIQ_PG_URL and
    DRAMATIQ_PG_SCHEMA)."""


class CodeTooOld(SchemaVersionError):
    """The database's schema had a breaking migration that this release of
    dramatiq-pg-broker does not know: it may no longer use the schema. Upgrade the
    package."""


class JobNotFound(PgBrokerError):
    """No job has this id."""


class InvalidJobId(PgBrokerError, ValueError):
    """A job id is neither a UUID nor the start of one with at least 8 hex characters."""


class AmbiguousJobId(PgBrokerError):
    """A job id prefix matches more than one job: give more of its characters.

    Attributes:
      prefix(str): the prefix as given.
      candidates(list[dict]): the matching jobs (``id``, ``queue_name``, ``actor_name``,
        ``status``, ``created_at``), in id order, at most
        :data:`~dramatiq_pg_broker.jobs.rows.MAX_ID_CANDIDATES` of them.
      more(bool): whether more jobs match than are listed.
    """

    def __init__(self, prefix: str, candidates: list[dict], more: bool = False) -> None:
        self.prefix = prefix
        self.candidates = candidates
        self.more = more
        count = f"more than {len(candidates)}" if more else str(len(candidates))
        super().__init__(
            f"job id prefix {prefix!r} is ambiguous: {count} jobs start with it; "
            "give more of its characters"
        )


class InvalidTransition(PgBrokerError):
    """The job is not in a status that allows this change."""

    def __init__(self, job_id: object, status: str, done: str, allowed: str) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(f"job {job_id} is {status}: only {allowed} jobs can be {done}")


class WorkflowNotFound(JobNotFound):
    """No workflow has this id."""


class WorkflowInvalidTransition(InvalidTransition):
    """The workflow is not in a status that allows this change."""

    def __init__(self, workflow_id: object, status: str, done: str, allowed: str) -> None:
        self.job_id = workflow_id
        self.workflow_id = workflow_id
        self.status = status
        PgBrokerError.__init__(
            self, f"workflow {workflow_id} is {status}: only {allowed} workflows can be {done}"
        )


class WorkflowStillStopping(WorkflowInvalidTransition):
    """Jobs of the workflow that an abort interrupted have not ended yet: each ends
    cancelled, and would cancel the workflow again. Retry once they have ended."""

    def __init__(self, workflow_id: object, stopping: int) -> None:
        self.job_id = workflow_id
        self.workflow_id = workflow_id
        self.status = "cancelled"
        PgBrokerError.__init__(
            self,
            f"workflow {workflow_id} has {stopping} aborted job(s) still stopping: retry it "
            "once they have ended (each would cancel it again)",
        )


class WorkflowTimeout(PgBrokerError):
    """The workflow did not end within the time given to wait for it."""


class NotAWorkflowStep(PgBrokerError):
    """spawn() adds children to a workflow's step: the current job is not one."""


class WorkflowResultNotEncodable(PgBrokerError):
    """A workflow's step returned a value the message encoder cannot write, and a step
    after it takes that value as its input: the step fails, as a pipeline's send of the
    next message would."""


class DuplicateJobId(InvalidTransition):
    """A job id has more than one row (queued or running in jobs and finished in history,
    or finished twice in history), which earlier releases could leave: the job is not
    retried, so that no id ever gets a third row. Look at its rows and delete the one that
    is not wanted."""

    def __init__(self, job_id: object) -> None:
        self.job_id = job_id
        self.status = "duplicated"
        PgBrokerError.__init__(
            self,
            f"job {job_id} has a second row (an earlier release could leave one: queued "
            "again while it finished, or finished twice): it was not retried; look at its "
            "rows and delete the one that is not wanted",
        )


class JobBusy(PgBrokerError):
    """The job's row is held by another transaction (the application's transaction of a
    ``complete_in()`` block, which wrote the job's success, holds it until it commits or
    rolls back): the request waited as long as it was allowed to and changed nothing."""

    def __init__(self, job_id: object, holder: str) -> None:
        self.job_id = job_id
        super().__init__(holder)


class InvalidMessage(PgBrokerError, ValueError):
    """A message cannot be sent as it is: an option is out of range, or the configured
    encoder cannot encode one of its values. Nothing was written."""


class JobAlreadyFinished(PgBrokerError):
    """A message was enqueued again with the id of a job that already finished
    (succeeded, failed or cancelled): it was not sent. Send a new message instead
    (``message.copy(message_id=...)`` or ``actor.send(...)``)."""

    def __init__(self, job_id: object, status: str) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(
            f"job {job_id} is already {status}: a message with its id cannot be enqueued "
            "again; send a new message (with a new message_id) instead"
        )


class TransactionError(PgBrokerError):
    """``broker.transaction()`` was given a connection it cannot write jobs on."""


class LostOwnership(PgBrokerError):
    """This worker no longer owns the job's attempt (its lease expired and the job went to
    another worker, or an operator aborted it): a ``current_job().complete_in()`` block
    did not complete the job, and raised before its transaction committed, so that the
    actor's writes in it roll back."""


class QueueNotDeclared(PgBrokerError):
    """No worker has declared this queue: check its name, or pause it ahead of its workers
    with ``--force``."""


class InvalidQueueLimit(PgBrokerError, ValueError):
    """A queue limit must be a whole number of at least 1: pause a queue to stop it, clear
    its limit to lift it."""


class InvalidQueueName(PgBrokerError, ValueError):
    """The name cannot be a queue's: Dramatiq's queue names are a letter or '_', then
    letters, digits, '.', '_' or '-'."""


class ActorNotDeclared(PgBrokerError):
    """No worker has declared an actor of this name, so no job of it would ever run."""


class JobInterrupted(PgBrokerError):
    """The job's attempts were interrupted too often (its worker died, hung or lost its
    lease each time), so it failed without its actor raising."""


class JobAborted(Interrupt):
    """An operator aborted the job this actor was running: the job ends cancelled, is never
    retried nor run again. Raised in the actor's thread by the worker, or by
    ``current_job().raise_if_aborted()``; an actor may catch it to clean up, then should
    re-raise it."""

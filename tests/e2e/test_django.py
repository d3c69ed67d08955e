"""The Django integration, with the example project (``examples/django``), real
PostgreSQL and a real worker started by ``python manage.py rundramatiq``.

The project's tables and the broker's live in a schema of the module's own: the broker's
created by ``manage.py dramatiq_pg_migrate``, Django's by ``manage.py migrate`` (the
database URL carries ``search_path``). Django is set up in this process too (once: Django
cannot be set up twice in a process), with the same settings, to run atomic blocks and the
view through Django's test client.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid

import dramatiq
import dramatiq.broker
import pytest
from psycopg.conninfo import make_conninfo

from dramatiq_pg_broker import TransactionError
from tests.helpers import drop_schema, new_schema_name
from tests.rows import created_count, event_types, status_of

from .workers import REPO, WorkerProcess, wait_for, wait_until_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROJECT = REPO / "examples" / "django"


@pytest.fixture(scope="module")
def project_env(pg_url):
    """The example project's environment: its database (with a schema of this module's
    own on the search path) and the broker's schema."""
    schema = new_schema_name("dj")
    env = {
        "DATABASE_URL": make_conninfo(pg_url, options=f"-c search_path={schema}"),
        "DRAMATIQ_PG_SCHEMA": schema,
    }
    yield env
    drop_schema(pg_url, schema)


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``python manage.py <args>`` in the example project, as its user would run it."""
    environ = {**os.environ, **env}
    environ.pop("DRAMATIQ_PG_URL", None)  # the project's database is its settings'
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def migrated(project_env):
    """``manage.py dramatiq_pg_migrate`` then ``manage.py migrate``: the broker's tables
    (with its schema), then Django's and the shop's in it."""
    broker_tables = manage(project_env, "dramatiq_pg_migrate")
    assert broker_tables.returncode == 0, broker_tables.stdout + broker_tables.stderr
    assert "applying 0001_" in broker_tables.stdout, broker_tables.stdout
    django_tables = manage(project_env, "migrate", "--no-input")
    assert django_tables.returncode == 0, django_tables.stdout + django_tables.stderr
    return project_env


@pytest.fixture(scope="module")
def django_project(migrated):
    """Django, set up in this process with the example project's settings."""
    import django

    saved = {key: os.environ.get(key) for key in (*migrated, "DJANGO_SETTINGS_MODULE")}
    previous_broker = dramatiq.broker.global_broker
    os.environ.update(migrated, DJANGO_SETTINGS_MODULE="exampleproject.settings")
    sys.path.insert(0, str(PROJECT))
    try:
        django.setup()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    broker = dramatiq.get_broker()
    yield broker
    from django.db import connections

    connections.close_all()
    broker.close()
    if previous_broker is not None:
        dramatiq.set_broker(previous_broker)
    sys.path.remove(str(PROJECT))


@pytest.fixture(scope="module")
def worker(migrated, pg_url, tmp_path_factory):
    """``python manage.py rundramatiq --processes 1 --threads 2``, ready for action."""
    log = tmp_path_factory.mktemp("django-worker") / "worker.log"
    process = WorkerProcess(
        pg_url,
        migrated["DRAMATIQ_PG_SCHEMA"],
        log,
        cwd=PROJECT,
        command=[sys.executable, "manage.py", "rundramatiq", "--processes", "1", "--threads", "2"],
        DATABASE_URL=migrated["DATABASE_URL"],
    )
    process.wait_ready(what="the rundramatiq worker to start")
    yield process
    process.kill_group()


@pytest.fixture
def own_broker(django_project, migrated):
    """``own_broker(**options)``: a broker of the Django integration besides the project's
    (on its schema unless ``options`` say otherwise) and an actor of it that does nothing,
    on a queue of its own; the broker is closed afterwards."""
    from dramatiq_pg_broker.contrib.django import PostgresBroker

    brokers = []

    def make(**options):
        options.setdefault("schema", migrated["DRAMATIQ_PG_SCHEMA"])
        broker = PostgresBroker(**options)
        brokers.append(broker)
        queue = f"own_{uuid.uuid4().hex[:6]}"
        return broker, dramatiq.actor(lambda: None, broker=broker, queue_name=queue)

    yield make
    for broker in brokers:
        broker.close()


def test_the_broker_is_the_django_one_on_django_s_database(django_project, migrated):
    from dramatiq_pg_broker.contrib.django import PostgresBroker

    assert isinstance(django_project, PostgresBroker)
    assert django_project.settings.schema == migrated["DRAMATIQ_PG_SCHEMA"]
    assert "search_path" in django_project.pool.url  # the DATABASES entry's OPTIONS


def test_a_rolled_back_atomic_block_leaves_no_job_and_no_event(django_project):
    from django.db import transaction
    from shop.models import Order
    from shop.tasks import send_receipt

    with pytest.raises(RuntimeError):
        with transaction.atomic():
            order = Order.objects.create(item="tea")
            message = send_receipt.send(order.pk)
            raise RuntimeError("the view changed its mind")
    assert status_of(django_project.store, message.message_id) is None
    assert event_types(django_project.store, message.message_id) == []
    assert not Order.objects.filter(pk=order.pk).exists()


def test_a_committed_block_s_job_is_invisible_until_the_commit_then_runs(django_project, worker):
    from django.db import transaction
    from shop.models import Order
    from shop.tasks import send_receipt

    earlier = Order.objects.create(item="water")
    with transaction.atomic():
        # The send is the block's first statement: the transaction begins with it.
        first = send_receipt.send(earlier.pk)
        order = Order.objects.create(item="coffee")
        message = send_receipt.send(order.pk)
        for job in (first, message):
            assert status_of(django_project.store, job.message_id) is None, (
                "the job was visible to another connection before the commit"
            )
    wait_until_run(django_project, worker, first.message_id)
    wait_until_run(django_project, worker, message.message_id)
    order.refresh_from_db()
    assert order.receipt_sent_at is not None
    assert event_types(django_project.store, message.message_id)[0] == "created"


def test_a_savepoint_rolled_back_drops_only_its_own_sends(django_project, worker):
    from django.db import transaction
    from shop.models import Order
    from shop.tasks import send_receipt

    with transaction.atomic():
        kept_order = Order.objects.create(item="bread")
        kept = send_receipt.send(kept_order.pk)
        try:
            with transaction.atomic():
                dropped_order = Order.objects.create(item="cake")
                with django_project.batch():
                    dropped = [send_receipt.send(dropped_order.pk) for _ in range(2)]
                raise RuntimeError("this part is undone")
        except RuntimeError:
            pass
        also_kept = send_receipt.send(kept_order.pk)
    wait_until_run(django_project, worker, kept.message_id)
    wait_until_run(django_project, worker, also_kept.message_id)
    for message in dropped:
        assert status_of(django_project.store, message.message_id) is None
        assert event_types(django_project.store, message.message_id) == []
    assert not Order.objects.filter(pk=dropped_order.pk).exists()


def test_outside_an_atomic_block_a_send_commits_at_once(django_project):
    from shop.models import Order
    from shop.tasks import send_receipt

    message = send_receipt.send(Order.objects.create(item="salt").pk)
    # Committed at once: the row is there. The module's worker (started by an earlier
    # test) may already have claimed or even run it by the time this reads it.
    assert status_of(django_project.store, message.message_id) in {
        "queued",
        "running",
        "succeeded",
    }


def test_the_view_commits_the_order_with_its_job_and_the_worker_runs_it(django_project, worker):
    from django.test import Client

    client = Client()
    created = client.post("/orders/", {"item": "tea", "quantity": "2"})
    assert created.status_code == 201, created.content
    body = created.json()
    wait_until_run(django_project, worker, body["job"])
    shown = client.get(f"/orders/{body['order']}/").json()
    assert shown["receipt_sent_at"] is not None


def test_the_view_s_refused_order_takes_its_job_with_it(django_project, migrated, conn):
    from django.test import Client
    from shop.models import Order

    schema = migrated["DRAMATIQ_PG_SCHEMA"]
    created = created_count(conn, schema)
    orders = Order.objects.count()
    refused = Client().post("/orders/", {"item": "tea", "quantity": "11"})
    assert refused.status_code == 409, refused.content
    assert Order.objects.count() == orders
    assert created_count(conn, schema) == created, "the refused order's job was created"


def sent_in_a_rolled_back_block(actor: dramatiq.Actor, why: str) -> dramatiq.Message:
    """Send with ``actor`` inside an atomic block that then rolls back; return the message."""
    from django.db import transaction

    with pytest.raises(RuntimeError):
        with transaction.atomic():
            message = actor.send()
            raise RuntimeError(why)
    return message


def test_join_atomic_off_sends_through_the_broker_s_own_connections(own_broker):
    broker, actor = own_broker(join_atomic=False)
    message = sent_in_a_rolled_back_block(actor, "rolled back, but the job committed on its own")
    assert status_of(broker.store, message.message_id) == "queued"


def test_a_broker_url_of_its_own_is_checked_against_django_s_connection(own_broker, pg_url):
    from django.db import transaction

    same, actor = own_broker(url=pg_url)
    message = sent_in_a_rolled_back_block(actor, "rolled back")
    assert status_of(same.store, message.message_id) is None
    # The check itself: a connection that reaches another database is refused.
    # What the sender learned at the block above; no public call makes it learn again.
    same.sender._identity = ("another", None)
    same.sender.broker_identity = lambda: ("another", None)
    with transaction.atomic():
        with pytest.raises(TransactionError, match="cannot span two databases"):
            actor.send()


def test_a_failed_write_marks_the_atomic_block_for_rollback(own_broker):
    from django.db import connection, transaction

    from dramatiq_pg_broker import SchemaMissing

    broker, actor = own_broker(schema="no_such_schema_here")
    broker.pool.check_schema = lambda: None  # let the statement reach the server
    with transaction.atomic():
        with pytest.raises(SchemaMissing):
            actor.send()
        assert connection.needs_rollback, "Django would have committed an aborted block"


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_start_up_refuses_a_database_the_broker_cannot_use(django_project):
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from dramatiq_pg_broker.contrib.django import PostgresBroker

    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    psycopg2 = {"ENGINE": "tests.e2e.psycopg2_backend", "NAME": "shop"}
    with override_settings(DATABASES={"default": sqlite, "old": psycopg2}):
        with pytest.raises(ImproperlyConfigured, match="not in DATABASES"):
            PostgresBroker(database="missing")
        with pytest.raises(ImproperlyConfigured, match="sqlite backend, not PostgreSQL"):
            PostgresBroker(join_atomic=False)
        with pytest.raises(ImproperlyConfigured, match="through psycopg2, not psycopg 3"):
            PostgresBroker(database="old")
        # Without joining atomic blocks, psycopg2 is Django's business: the broker has its
        # own psycopg 3 connections.
        PostgresBroker(database="old", join_atomic=False).close()


def test_the_connection_string_follows_the_databases_entry():
    from psycopg.conninfo import conninfo_to_dict

    from dramatiq_pg_broker.contrib.django.database import conninfo_from

    entry = {
        "NAME": "shop",
        "USER": "app",
        "PASSWORD": "s3cret",
        "HOST": "db.example",
        "PORT": 6432,
        "OPTIONS": {
            "sslmode": "verify-full",
            "connect_timeout": 5,
            "isolation_level": 1,
            "server_side_binding": True,
            "pool": {"min_size": 2},
            "cursor_factory": object,
        },
    }
    assert conninfo_to_dict(conninfo_from(entry)) == {
        "dbname": "shop",
        "user": "app",
        "password": "s3cret",
        "host": "db.example",
        "port": "6432",
        "sslmode": "verify-full",
        "connect_timeout": "5",
    }
    assert conninfo_to_dict(conninfo_from({"NAME": None, "OPTIONS": {}})) == {"dbname": "postgres"}
    service = conninfo_to_dict(conninfo_from({"NAME": "", "OPTIONS": {"service": "shop"}}))
    assert service == {"service": "shop"}


def test_manage_py_runs_the_operator_commands_on_the_broker_s_database(migrated):
    status = manage(migrated, "dramatiq_pg", "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"schema {migrated['DRAMATIQ_PG_SCHEMA']!r}" in status.stdout
    assert "fits the schema" in status.stdout
    check = manage(migrated, "dramatiq_pg_migrate", "--check")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("inside_atomic", [False, True], ids=["begins", "joins-atomic"])
def test_complete_in_commits_the_success_with_the_actor_s_django_writes(
    django_project, migrated, conn, inside_atomic
):
    """``current_job().complete_in(django.db.connection)`` in an actor run by an
    in-process worker of the Django broker: alone it begins and commits a transaction
    (``atomic()``); inside ``transaction.atomic()`` it is a savepoint and the job succeeds
    with the application's commit. A first attempt whose atomic block raises leaves no
    row: the job is retried, and its second attempt's row is the only one."""
    from django.db import connection, transaction

    from dramatiq_pg_broker import current_job

    schema = migrated["DRAMATIQ_PG_SCHEMA"]
    table = f"cin_django_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE TABLE "{schema}"."{table}" (job_id uuid, attempt int)')
    broker = django_project
    queue = f"cin_{uuid.uuid4().hex[:8]}"

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=queue, min_backoff=10)
    def work():
        job = current_job()

        def effect():
            with connection.cursor() as cursor:
                cursor.execute(f'INSERT INTO "{table}" VALUES (%s, %s)', (job.id, job.attempt))

        if inside_atomic:
            with transaction.atomic():
                with job.complete_in(connection):
                    effect()
                if job.attempt == 1:
                    raise RuntimeError("the atomic block fails after complete_in()")
        else:
            with job.complete_in(connection):
                effect()
                if job.attempt == 1:
                    raise RuntimeError("the block fails")

    message = work.send()
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        wait_for(
            lambda: status_of(broker.store, message.message_id) == "succeeded",
            30,
            "the job to succeed",
            on_timeout=lambda: f"status: {status_of(broker.store, message.message_id)}",
        )
    finally:
        worker.stop(timeout=10_000)
        # The broker outlives the worker: Dramatiq's middleware of a stopped worker would
        # still add consumers (threads nobody runs) for the queues declared after it.
        broker.middleware[:] = [
            m for m in broker.middleware if getattr(m, "worker", None) is not worker
        ]
    rows = conn.execute(f'SELECT job_id::text, attempt FROM "{schema}"."{table}"').fetchall()
    assert rows == [(message.message_id, 2)], rows
    types = event_types(broker.store, message.message_id)
    assert types.count("succeeded") == 1 and types.count("retry_scheduled") == 1, types
    [succeeded] = [
        e for e in broker.store.events_of(message.message_id) if e["type"] == "succeeded"
    ]
    assert succeeded["data"] == {"in_transaction": True}


@pytest.mark.parametrize("inside_atomic", [False, True], ids=["begins", "joins-atomic"])
def test_complete_in_at_repeatable_read_outlasts_the_worker_s_writes(
    django_project, migrated, conn, inside_atomic
):
    """A Django connection at REPEATABLE READ whose block lasts past the worker's start
    record (0.1 s in): one attempt, one row. Inside ``atomic()`` the block's statement is
    the transaction's first read."""
    from django.db import connection, transaction
    from psycopg import IsolationLevel

    from dramatiq_pg_broker import current_job

    schema = migrated["DRAMATIQ_PG_SCHEMA"]
    table = f"cin_django_rr_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE TABLE "{schema}"."{table}" (job_id uuid, attempt int)')
    broker = django_project
    queue = f"cin_rr_{uuid.uuid4().hex[:8]}"

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=queue, max_retries=0)
    def work():
        job = current_job()
        connection.ensure_connection()
        connection.connection.isolation_level = IsolationLevel.REPEATABLE_READ
        try:
            with transaction.atomic() if inside_atomic else contextlib.nullcontext():
                with job.complete_in(connection):
                    with connection.cursor() as cursor:
                        cursor.execute(
                            f'INSERT INTO "{table}" VALUES (%s, %s)', (job.id, job.attempt)
                        )
                    time.sleep(0.4)
        finally:
            connection.connection.isolation_level = None

    message = work.send()
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        wait_for(
            lambda: status_of(broker.store, message.message_id) in ("succeeded", "failed"),
            30,
            "the job to finish",
        )
    finally:
        worker.stop(timeout=10_000)
        broker.middleware[:] = [
            m for m in broker.middleware if getattr(m, "worker", None) is not worker
        ]
    job = broker.store.get(message.message_id)
    assert (job["status"], job["attempts"]) == ("succeeded", 1), job["last_error"]
    rows = conn.execute(f'SELECT job_id::text, attempt FROM "{schema}"."{table}"').fetchall()
    assert rows == [(message.message_id, 1)], rows

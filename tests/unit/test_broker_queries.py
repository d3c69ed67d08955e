"""The named SQL: every statement name the code looks up exists in the package's sql/*.sql."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

import dramatiq_pg_broker
from dramatiq_pg_broker.db import Queries, load_fragments, load_queries
from dramatiq_pg_broker.jobs import channel_name
from dramatiq_pg_broker.retries import backoff_ms

REPO = Path(dramatiq_pg_broker.__file__).resolve().parent.parent
#: Packages whose code may look up named statements of the broker's queries.sql.
PACKAGES = ["dramatiq_pg_broker", "admin_api"]


def _python_files():
    for package in PACKAGES:
        root = REPO / package
        if root.is_dir():
            yield from sorted(root.rglob("*.py"))


def _names_used(path: Path) -> set[tuple[str, int]]:
    """String constants used as ``<...>.queries["name"]``, ``queries["name"]``, as the
    first argument of ``<...>._fetch("name", ...)`` or the second of
    ``<...>._probing(c, "name", ...)``."""
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            target = node.value
            named = (isinstance(target, ast.Attribute) and target.attr == "queries") or (
                isinstance(target, ast.Name) and target.id == "queries"
            )
            if named and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.add((node.slice.value, node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            position = {"_fetch": 0, "_probing": 1}.get(getattr(func, "attr", None), -1)
            if isinstance(func, ast.Attribute) and 0 <= position < len(node.args):
                named = node.args[position]
                if isinstance(named, ast.Constant) and isinstance(named.value, str):
                    found.add((named.value, node.lineno))
    return found


def _sql_files() -> list[str]:
    return sorted(
        f.name
        for f in resources.files("dramatiq_pg_broker").joinpath("sql").iterdir()
        if f.name.endswith(".sql")
    )


def test_every_query_name_used_in_code_exists():
    defined = set().union(*(load_queries(name) for name in _sql_files()))
    used: dict[str, list[str]] = {}
    for path in _python_files():
        for name, line in _names_used(path):
            used.setdefault(name, []).append(f"{path.relative_to(REPO)}:{line}")
    # The scan must actually see the state machine's lookups, or it proves nothing.
    assert {"claim_jobs", "complete_jobs", "reap_expired", "insert_job"} <= set(used), (
        f"the scan found too few query lookups to be trusted: {sorted(used)}"
    )
    missing = {name: where for name, where in used.items() if name not in defined}
    assert not missing, f"query names used in code but absent from sql/*.sql: {missing}"


@pytest.mark.parametrize("filename", _sql_files())
def test_query_names_are_unique_and_every_block_has_a_description_and_a_statement(filename):
    text = resources.files("dramatiq_pg_broker").joinpath("sql", filename).read_text("utf-8")
    headers = re.findall(r"^-- (\w+) --\s*$", text, flags=re.MULTILINE)
    duplicates = sorted({h for h in headers if headers.count(h) > 1})
    assert not duplicates, f"a later block silently replaces an earlier one: {duplicates}"
    blocks = re.split(r"^-- \w+ --\s*$", text, flags=re.MULTILINE)[1:]
    for name, body in zip(headers, blocks):
        lines = body.strip().splitlines()
        assert lines and lines[0].startswith("-- "), f"{name}: no one-line description"
        blocks = {**load_queries(filename), **load_fragments(filename)}
        assert blocks[name], f"{name}: no statement"


def test_schema_is_filled_in_as_an_identifier():
    queries = Queries("weird_schema")
    assert '"weird_schema".jobs' in queries["claim_jobs"]
    assert "{schema}" not in " ".join(queries[name] for name in load_queries())


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 100), (2, 200), (3, 400), (4, 800), (5, 1000), (30, 1000), (10_000, 1000)],
)
def test_backoff_doubles_per_attempt_up_to_the_maximum(attempt, expected):
    assert backoff_ms(attempt, 100, 1000) == expected


def test_channel_names_fit_postgres_identifier_limit():
    short = channel_name("dramatiq", "default")
    assert short == "dramatiq.default"
    long_a = channel_name("dramatiq", "q" * 80)
    long_b = channel_name("dramatiq", "q" * 79 + "r")
    assert len(long_a.encode()) <= 63 and len(long_b.encode()) <= 63
    assert long_a != long_b, "two long queue names share one channel"


def test_every_form_of_a_send_lists_the_send_fields_in_one_order():
    """The parameters of insert_job, the arrays of insert_jobs and the staging table all
    follow jobs.SEND_FIELDS, the one definition send_values() fills."""
    from dramatiq_pg_broker.jobs import SEND_FIELDS, NewJob, send_values

    names = [name for name, _ in SEND_FIELDS]
    queries = load_queries()
    arrays = re.findall(r"%\((\w+)\)s::\w+\[\]", queries["insert_jobs"].split("WITH ORDINALITY")[0])
    assert arrays == names, "insert_jobs' arrays"
    staged = re.findall(r"(\w+) \w+(?:,|\n|\))", queries["stage_jobs"].split("(", 1)[1])
    assert staged == [*names, "position"], "the staging table's columns"
    single = set(re.findall(r"%\((\w+)\)s", queries["insert_job"]))
    assert set(names) <= single, "insert_job's parameters"
    job = NewJob("00000000-0000-0000-0000-000000000001", "q", "a", max_attempts=3, delay_ms=-5)
    values = dict(zip(names, send_values(job)))
    assert (values["max_attempts"], values["delay_ms"], values["message"]) == (3, 0, None)


def test_the_clock_slack_of_the_statements_is_the_code_s():
    """The send statements' history probe and the probe's partitions (history_probe.py)
    allow the same difference of clocks: {clock_slack_ms} is filled in from the constant."""
    from dramatiq_pg_broker.history.probe import CLOCK_SLACK_MS

    queries = load_queries()
    users = [name for name, text in queries.items() if "sent_at_ms" in text]
    assert {"insert_job", "insert_jobs", "find_existing", "copied_in_history"} <= set(users)
    for name in users:
        if "jobs_history" in queries[name]:
            assert f"- {CLOCK_SLACK_MS})" in queries[name], name
    assert not any("{clock_slack_ms}" in text for text in queries.values())


#: The identifier places a file has besides {schema}, filled in by the code that reads it.
IDENTIFIERS = {"expiring_rows.sql": {"{table}", "{key}"}}


def test_every_macro_is_expanded_and_only_the_schema_is_left():
    for filename in _sql_files():
        allowed = {"{schema}"} | IDENTIFIERS.get(filename, set())
        for name, text in load_queries(filename).items():
            left = re.sub(r"\{\{\w+\}\}", "", text)  # {{x}}: a literal {x}, for psycopg
            assert set(re.findall(r"\{[^}]*\}", left)) <= allowed, (filename, name)


def test_a_row_macro_passes_every_column_through_unless_assigned():
    from dramatiq_pg_broker.db import expand_macros

    blocks = {"job_columns": "id, status, note", "finished_row": "status = 'done'"}
    assert expand_macros("SELECT {job_columns}", blocks) == "SELECT id, status, note"
    assert expand_macros("SELECT {job_row: }", blocks) == "SELECT id, status, note"
    assert expand_macros("SELECT {finished_row}", blocks) == "SELECT id, 'done', note"
    # The statement's assignments win over the fragment's; commas inside parentheses and
    # quotes belong to the expression.
    text = "{finished_row: status = coalesce(a, 'b,c'), note = f(x, y)}"
    assert expand_macros(text, blocks) == "id, coalesce(a, 'b,c'), f(x, y)"
    assert expand_macros("{schema}.jobs", blocks) == "{schema}.jobs"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{job_row: statsu = 'done'}", "'statsu', which is not a column"),
        ("{job_row: status 'done'}", "not `column = expression`"),
        ("{schema: x = 1}", "no macro of this file"),
    ],
)
def test_a_row_macro_that_names_no_column_of_the_row_is_refused(text, error):
    from dramatiq_pg_broker.db import expand_macros

    with pytest.raises(ValueError, match=re.escape(error)):
        expand_macros(text, {"job_columns": "id, status"})


def test_a_piece_of_statement_fills_its_slots_and_hands_its_row_the_rest():
    """A statement-level fragment (move_to_history's form): slot values, a list that runs
    on over the commas, the assignments to the job's columns in its row macro."""
    from dramatiq_pg_broker.db import expand_macros

    blocks = {
        "job_columns": "id, status, note",
        "finished_row": "status = 'done'",
        "move": "DELETE x{:using} WHERE {:on} RETURNING j.*{:returning}; "
        "SELECT {finished_row: {:row}} FROM x{:ended}",
    }
    text = "{move: on = j.id = 1, returning = a, b AS c, note = f(x, y), ended = id, note}"
    assert expand_macros(text, blocks) == (
        "DELETE x WHERE j.id = 1 RETURNING j.*, a, b AS c; "
        "SELECT id, 'done', f(x, y) FROM x\nRETURNING id, note"
    )
    assert expand_macros("{move: using = t, on = true}", blocks).startswith(
        "DELETE x USING t WHERE true RETURNING j.*;"
    )
    with pytest.raises(ValueError, match="not a column"):
        expand_macros("{move: on = true, notes = 1}", blocks)
    with pytest.raises(ValueError, match="not `column = expression`"):
        expand_macros("{move: on = true, status = 'x', stray}", blocks)


def test_every_job_that_ends_moves_through_the_one_piece():
    """The delete from jobs and the insert into history are written once (move_to_history)
    and every finishing statement composes them."""
    queries = load_queries()
    finishing = [name for name, text in queries.items() if "jobs_history (" in text]
    assert sorted(finishing) == sorted(
        ["complete_jobs", "complete_in_transaction", "fail_jobs", "abort_attempts"]
        + ["cancel_skipped", "cancel_job", "abort_job", "reschedule_job", "reap_expired"]
    )
    for name in finishing:
        assert "), moved AS (\n    INSERT INTO {schema}.jobs_history" in queries[name], name


def test_the_ownership_guard_takes_each_statement_s_arrays_and_condition():
    """The fragment owned_attempts, written once, as each exit from running uses it."""
    queries = {name: " ".join(text.split()) for name, text in load_queries().items()}
    assert (
        "%(attempts)s::int[], %(errors)s::text[]) AS o (id, owner, attempt, error)"
        in queries["fail_jobs"]
    )
    assert "SELECT j.id, j.lane, o.owner, o.skip FROM" in queries["cancel_skipped"]
    assert "j.attempts = o.attempt AND NOT j.started ORDER BY j.id" in queries["release_jobs"]
    assert "j.attempts = o.attempt ORDER BY j.id FOR UPDATE OF j" in queries["complete_jobs"]


def test_the_backends_share_their_statements_each_table_and_key_as_identifiers():
    """results, rate_limits and abort_events: one statement that reads a live key, one that
    deletes expired rows, each table's name and key column filled in as identifiers
    (quoted), never as text."""
    from dramatiq_pg_broker.backends.abort import PostgresEventBackend
    from dramatiq_pg_broker.backends.rate_limits import PostgresRateLimiterBackend
    from dramatiq_pg_broker.backends.results import PostgresBackend

    odd = Queries("s", "expiring_rows.sql", identifiers={"table": 'a"b', "key": "K"})
    assert 'DELETE FROM "s"."a""b"\nWHERE "K" IN' in odd["prune_expired"]
    expected = {
        PostgresBackend: ('"results"', '"key"'),
        PostgresRateLimiterBackend: ('"rate_limits"', '"key"'),
        PostgresEventBackend: ('"abort_events"', '"id"'),
    }
    for backend, (table, key) in expected.items():
        statements = backend.expiring_statements("weird_schema")
        prune = statements["prune_expired"]
        assert prune.startswith(f'DELETE FROM "weird_schema".{table}\nWHERE {key} IN'), prune
        assert "LIMIT %(limit)s" in prune
        assert f'FROM "weird_schema".{table}\nWHERE {key} = %(key)s' in statements["live_value"]

"""The compatibility contract of migrations: every file from 0010 on says whether it is
compatible or breaking, and why; the handshake's verdicts follow from the headers."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import dramatiq_pg_broker
from dramatiq_pg_broker.db.handshake import AppliedMigration, Code, SchemaState, this_code, verify
from dramatiq_pg_broker.errors import CodeTooOld, MigrationError, MigrationsPending, SchemaMissing
from dramatiq_pg_broker.migrate import (
    BREAKING,
    COMPATIBLE,
    CONTRACT_FROM,
    Migration,
    discover,
    migrations_dir,
    parse_header,
    parse_transaction,
    units,
)

REPO = Path(dramatiq_pg_broker.__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "guides" / "upgrading.md"


def test_every_migration_from_0010_on_has_its_compatibility_header():
    shipped = discover()
    under_contract = [m for m in shipped if m.version >= CONTRACT_FROM]
    assert under_contract, "migration 0010, which starts the contract, is missing"
    for migration in under_contract:
        first, second = migration.read().splitlines()[:2]
        assert first in (f"-- compatibility: {COMPATIBLE}", f"-- compatibility: {BREAKING}"), (
            f"{migration.filename}: the first line must be the compatibility header, not {first!r}"
        )
        assert second.startswith("-- ") and second[3:].strip(), (
            f"{migration.filename}: the second line must say why it is {migration.compatibility}"
        )
    for migration in shipped:
        if migration.version < CONTRACT_FROM:
            assert migration.compatibility is None, (
                f"{migration.filename} was released before the contract and must not change"
            )


def test_the_upgrading_guide_names_the_kind_of_every_migration_from_0010_on():
    text = GUIDE.read_text("utf-8")
    rows = dict(re.findall(r"^\| `(\d{4}_\w+)` \| (compatible|breaking) \|", text, re.MULTILINE))
    for migration in discover():
        if migration.version < CONTRACT_FROM:
            continue
        label = f"{migration.version:04d}_{migration.name}"
        assert label in rows, (
            f"docs/guides/upgrading.md lists no row `| `{label}` | {migration.compatibility} "
            "| ...` in its table of migrations"
        )
        assert rows[label] == migration.compatibility, (
            f"the upgrading guide says {label} is {rows[label]}, its header says "
            f"{migration.compatibility}"
        )


def _folder_with(tmp_path: Path, filename: str, text: str) -> Path:
    folder = tmp_path / "migrations"
    shutil.copytree(migrations_dir(), folder)
    (folder / filename).write_text(text)
    return folder


def test_a_new_migration_without_the_header_is_refused_by_name(tmp_path):
    folder = _folder_with(tmp_path, "0999_no_header.sql", "CREATE TABLE t (id int);\n")
    with pytest.raises(MigrationError, match="0999_no_header.sql has no compatibility header"):
        discover(folder)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- compatibility: maybe\n-- why\nSELECT 1;\n", "'compatible' or 'breaking'"),
        ("-- compatibility: breaking\nSELECT 1;\n", "second line must be a comment"),
        ("-- compatibility: compatible\n--\nSELECT 1;\n", "second line must be a comment"),
    ],
)
def test_a_malformed_header_is_refused_saying_what_is_wrong(tmp_path, text, error):
    folder = _folder_with(tmp_path, "0999_bad_header.sql", text)
    with pytest.raises(MigrationError, match=error):
        discover(folder)


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("ALTER TABLE jobs ADD COLUMN x int;", "must hold exactly one CREATE"),
        ("CREATE INDEX x ON jobs (id);", "must hold exactly one CREATE"),
        (
            "CREATE INDEX CONCURRENTLY a ON jobs (id);\nCREATE INDEX CONCURRENTLY b ON jobs (id);",
            "must hold exactly one CREATE",
        ),
    ],
)
def test_a_migration_outside_a_transaction_holds_one_concurrent_index_statement(
    tmp_path, statement, error
):
    text = f"-- compatibility: compatible\n-- An index.\n-- transaction: none\n{statement}\n"
    folder = _folder_with(tmp_path, "0999_alone.sql", text)
    with pytest.raises(MigrationError, match=error):
        discover(folder)


def test_the_transaction_line_is_parsed():
    header = "-- compatibility: compatible\n-- An index.\n"
    assert parse_transaction("0999_x.sql", header + "SELECT 1;\n")
    for statement in (
        "CREATE INDEX CONCURRENTLY jobs_x_idx ON jobs (queue_name);",
        "-- why\ncreate unique index concurrently if not exists jobs_x_idx\n  ON jobs (id)\n",
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_x_idx;",
    ):
        text = header + "-- transaction: none\n" + statement
        assert not parse_transaction("0999_x.sql", text), statement
    with pytest.raises(MigrationError, match="the only value is `none`"):
        parse_transaction("0999_x.sql", header + "-- transaction: off\nSELECT 1;\n")


def _m(version: int, kind: str | None = "compatible", transactional: bool = True) -> Migration:
    return Migration(
        version, f"m{version}", Path(f"{version:04d}_m.sql"), "", kind, "why", transactional
    )


def test_from_the_first_breaking_migration_on_a_run_commits_in_one_transaction():
    """Each migration before the first breaking one alone, every one from it on together;
    one outside a transaction runs alone between two such transactions."""
    runs = units([_m(10), _m(11), _m(12, "breaking"), _m(13), _m(14, "breaking"), _m(15)])
    assert [[m.version for m in unit] for unit in runs] == [[10], [11], [12, 13, 14, 15]]
    runs = units([_m(1, None), _m(12, "breaking"), _m(13, transactional=False), _m(14)])
    assert [[m.version for m in unit] for unit in runs] == [[1], [12], [13], [14]]
    assert [[m.version for m in unit] for unit in units([_m(20), _m(21)])] == [[20], [21]]


def test_released_migrations_need_no_header():
    assert parse_header("0001_jobs.sql", "-- 0001: jobs\nCREATE TABLE jobs ();\n") == (None, None)
    assert [m.version for m in discover() if m.compatibility is None] == list(range(1, 10))


def test_the_header_is_parsed():
    text = "-- compatibility: breaking\n-- Renames a column the old reaper writes.\nSELECT 1;\n"
    assert parse_header("0999_x.sql", text) == (
        "breaking",
        "Renames a column the old reaper writes.",
    )


def test_this_code_is_the_package_version_and_its_highest_migration():
    code = this_code()
    assert code.version == dramatiq_pg_broker.__version__
    assert code.level == max(m.version for m in discover()) >= CONTRACT_FROM


# -- the handshake's verdicts, on states made up here ---------------------------------------


def _state(*rows: tuple[int, str | None, str | None]) -> SchemaState:
    return SchemaState("app", tuple(AppliedMigration(v, f"m{v}", kind, by) for v, kind, by in rows))


def _code(level: int, version: str = "9.9.9") -> Code:
    return Code(version, tuple(m for m in discover() if m.version <= level))


RELEASED = [(v, None, None) for v in range(1, 10)]


def test_a_schema_behind_the_code_is_refused_with_what_to_run():
    code = _code(10)
    with pytest.raises(MigrationsPending) as info:
        verify(_state(*RELEASED), code)
    line = str(info.value)
    assert "\n" not in line
    assert "schema 'app' is at migration 0009" in line
    assert "dramatiq-pg-broker 9.9.9 needs 0010 (1 pending: 0010_schema_handshake)" in line
    assert "run `dramatiq-pg-broker migrate`" in line
    # Callers that caught SchemaMissing before the handshake still do.
    assert isinstance(info.value, SchemaMissing)


def test_an_empty_schema_is_refused_with_every_migration_pending():
    with pytest.raises(MigrationsPending, match=r"has no migration applied.*\(10 pending: 0001"):
        verify(_state(), _code(10))


def test_code_older_than_the_schemas_minimum_is_refused_with_what_to_upgrade():
    state = _state(*RELEASED, (10, "compatible", "0.2.0"), (11, "breaking", "0.3.0"))
    with pytest.raises(CodeTooOld) as info:
        verify(state, _code(10, "0.2.0"))
    line = str(info.value)
    assert "\n" not in line
    assert "admits code of schema level 0011 or later" in line
    assert "m11 is breaking; dramatiq-pg-broker 0.3.0 applied it" in line
    assert "this is dramatiq-pg-broker 0.2.0 (schema level 0010)" in line
    assert "upgrade dramatiq-pg-broker on this host to a release that ships migration 0011" in line


def test_newer_compatible_migrations_admit_the_code():
    state = _state(*RELEASED, (10, "compatible", "0.2.0"), (11, "compatible", "0.3.0"))
    code = _code(10)
    verify(state, code)
    assert [m.version for m in state.unknown(code)] == [11]
    assert state.min_code_level == 0


def test_the_minimum_is_the_latest_breaking_migration():
    state = _state(
        *RELEASED, (10, "compatible", None), (11, "breaking", None), (12, "compatible", None)
    )
    assert state.min_code_level == 11
    assert state.raised_by.version == 11

"""The named statements: each ``sql/*.sql`` file's blocks, their macros expanded (the
job row's columns, the move to history, the constants shared with the code), bound to a
schema."""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

#: The package whose ``sql/`` folder holds the statements (the admin API names its own).
PACKAGE = "dramatiq_pg_broker"

_BLOCK_RE = re.compile(r"^-- (\w+) --\s*$", re.MULTILINE)
#: A macro in a statement: ``{name}`` or ``{name: assignments}`` (no braces inside).
_MACRO_RE = re.compile(r"(?<!\{)\{(\w+)(?::([^{}]*))?\}")
_ASSIGNMENT_RE = re.compile(r"^\s*(\w+)\s*=\s*(.*?)\s*$", re.DOTALL)

#: Clocks of sender and server may differ by this much (milliseconds): how far around a
#: send's time history is probed (see :mod:`dramatiq_pg_broker.history.probe`).
CLOCK_SLACK_MS = 3_600_000

#: Constants that statements share with the code, written ``{name}`` in the SQL and filled
#: in when the file is loaded, so that each is defined once (here).
CONSTANTS = {"clock_slack_ms": CLOCK_SLACK_MS}

#: The fragment holding the job row's columns, and the built-in row macro over them.
JOB_COLUMNS = "job_columns"
JOB_ROW = "job_row"
#: A fragment whose name ends so is a row fragment: assignments over the job row
#: (``finished_row``). Any other fragment is a piece of a statement (see :func:`expand_macros`).
ROW_SUFFIX = "_row"
#: The ownership guard: a piece of a statement whose slots take arrays (see :func:`_attempts`).
OWNED_ATTEMPTS = "owned_attempts"

#: A slot of a piece of a statement: ``{:name}``.
_SLOT_RE = re.compile(r"\{:(\w+)\}")
#: A reference to a block, expanded now or once a piece's slots are filled.
_REFERENCE_RE = re.compile(r"(?<!\{)\{(\w+)")
#: How a slot is filled from the values a statement gives it: the text before the first
#: value and between two (nothing at all when none is given). Any other slot: the values,
#: separated by commas.
SLOT_FORMS = {
    "using": (" USING ", ", "),
    "returning": (", ", ", "),
    "ended": ("\nRETURNING ", ", "),
}
#: The slot of a piece that takes the statement's assignments to the job's columns.
ROW_SLOT = "row"


@functools.cache
def _blocks(filename: str, package: str) -> dict[str, str]:
    text = resources.files(package).joinpath("sql", filename).read_text("utf-8")
    parts = _BLOCK_RE.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        blocks[name] = "\n".join(lines).strip()
    return blocks


@functools.cache
def load_fragments(filename: str = "queries.sql", package: str = PACKAGE) -> dict[str, str]:
    """The blocks of a file that its statements use as macros (see :func:`expand_macros`):
    ``{name: text}``, as written. They are no statements: :func:`load_queries` leaves them
    out."""
    blocks = _blocks(filename, package)
    used = {m.group(1) for text in blocks.values() for m in _REFERENCE_RE.finditer(text)}
    return {name: text for name, text in blocks.items() if name in used}


@functools.cache
def load_queries(filename: str = "queries.sql", package: str = PACKAGE) -> dict[str, str]:
    """Parse a file of named statements into ``{name: text}``, macros expanded.

    A block starts with a line ``-- name --``; the comment lines right after it describe
    the statement, the rest up to the next block is the statement. A block that other
    blocks use as a macro is a fragment (:func:`load_fragments`), not a statement: that is
    how queries.sql writes the job row and the ownership guard once (see
    :func:`expand_macros`).

    Parameters:
      filename(str): the file, in the package's ``sql/`` directory.
      package(str): the package holding it (the admin API keeps its own statements).
    """
    blocks = _blocks(filename, package)
    fragments = load_fragments(filename, package)
    return {
        name: expand_macros(body, blocks, filename)
        for name, body in blocks.items()
        if name not in fragments
    }


def expand_macros(text: str, blocks: dict[str, str], filename: str = "queries.sql") -> str:
    """Expand the macros of one statement: how a job row, and each move of it, is written
    once.

    - ``{job_columns}``: the columns of a job row, in table order: the block
      ``job_columns`` (a fragment, not a statement), which a test holds equal to the
      migrated ``jobs``, ``jobs_history`` and ``all_jobs``;
    - ``{job_row: column = expression, ...}``: a row's values in that order, each column
      the source row's own (its name) unless assigned;
    - ``{fragment_row: column = expression, ...}``, where the block ``fragment_row`` (a
      name ending in ``_row``) is itself a list of assignments (``finished_row``, what
      every move to history writes): the fragment's assignments, then the statement's,
      over ``{job_row}``;
    - ``{piece}``, ``{piece: slot = value, ..., column = expression, ...}``, where the
      block ``piece`` is part of a statement with ``{:slot}`` places (``move_to_history``,
      the delete from jobs and the insert into history of every job that ends): the
      piece, each slot filled with the values given for it (:data:`SLOT_FORMS`; a value
      runs on over the commas up to the next ``name =``), the assignments to the job's
      columns in its ``{:row}``, then its own macros expanded;
    - ``{owned_attempts}``, ``{owned_attempts: name = array, where = condition}``: the
      ownership guard of the exits from running, locking the rows in id order, written
      once (the block owned_attempts, whose ``{:slots}`` take the arrays and conditions);
    - ``{name}`` for a name of :data:`CONSTANTS`: its value.

    Anything else in braces (``{schema}``) is left for :class:`Queries`. A column a
    statement assigns that the row does not have is an error, raised when the file loads.

    Raises:
      ValueError: a macro names a column the job row does not have, or is malformed.
    """

    def one(match: re.Match) -> str:
        name, arguments = match.group(1), match.group(2)
        if name in CONSTANTS and arguments is None:
            return str(int(CONSTANTS[name]))
        if name == JOB_COLUMNS and arguments is None:
            return ", ".join(_columns(blocks, filename))
        if name != JOB_ROW and (name not in blocks or name == JOB_COLUMNS):
            if arguments is not None:
                raise ValueError(f"{filename}: {{{name}: ...}} is no macro of this file")
            return match.group(0)
        if name == OWNED_ATTEMPTS:
            return _attempts(blocks[name], _assignments(arguments or "", name, filename))
        if name != JOB_ROW and not name.endswith(ROW_SUFFIX):
            return expand_macros(_piece(name, blocks, arguments or "", filename), blocks, filename)
        columns = _columns(blocks, filename)
        values = {column: column for column in columns}
        given = _assignments(blocks[name], name, filename) if name != JOB_ROW else []
        given += _assignments(arguments or "", name, filename)
        for column, expression in given:
            if column not in values:
                raise ValueError(
                    f"{filename}: {{{name}: ...}} assigns {column!r}, which is not a column "
                    f"of the job row ({JOB_COLUMNS})"
                )
            values[column] = expression
        return ", ".join(values[column] for column in columns)

    return _MACRO_RE.sub(one, text)


def _piece(name: str, blocks: dict[str, str], arguments: str, filename: str) -> str:
    """The block ``name``, a piece of a statement, its ``{:slots}`` filled from
    ``arguments``: each ``slot = value`` (a value goes on over the commas up to the next
    ``name =``), and the assignments to the job's columns, as they were written, in the
    slot ``{:row}`` (where the piece writes a row macro)."""
    template = blocks[name]
    slots = set(_SLOT_RE.findall(template))
    filled: dict[str, list[str]] = {slot: [] for slot in slots}
    for slot, value in _assignments(arguments, name, filename, continued=slots - {ROW_SLOT}):
        if slot in slots and slot != ROW_SLOT:
            filled[slot].append(value)
        elif ROW_SLOT in slots:
            filled[ROW_SLOT].append(f"{slot} = {value}")
        else:
            raise ValueError(f"{filename}: {{{name}: ...}} has no slot {slot!r}")

    def fill(match: re.Match) -> str:
        values = filled[match.group(1)]
        lead, between = SLOT_FORMS.get(match.group(1), ("", ", "))
        return lead + between.join(values) if values else ""

    return _SLOT_RE.sub(fill, template)


def _attempts(template: str, given: list[tuple[str, str]]) -> str:
    """The fragment owned_attempts: each ``name = array`` is one more array of the unnest
    and one more column of its rows; ``where = condition`` one more condition on the row."""
    arrays = [(name, array) for name, array in given if name != "where"]
    where = "".join(f" AND {condition}" for name, condition in given if name == "where")
    return (
        template.replace("{:values}", "".join(f", o.{name}" for name, _ in arrays))
        .replace("{:arrays}", "".join(f", {array}" for _, array in arrays))
        .replace("{:names}", "".join(f", {name}" for name, _ in arrays))
        .replace("{:where}", where)
    )


def _columns(blocks: dict[str, str], filename: str) -> list[str]:
    if JOB_COLUMNS not in blocks:
        raise ValueError(f"{filename}: a job row macro, but no {JOB_COLUMNS} block")
    return [column.strip() for column in blocks[JOB_COLUMNS].split(",")]


def _assignments(
    text: str, name: str, filename: str, continued: set[str] | frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """``column = expression, ...`` split on the commas outside parentheses and quotes. An
    item that is no assignment goes on with the value before it when that value's name is
    one of ``continued`` (a slot taking a list: ``returning = a, b``)."""
    items: list[str] = []
    depth, quoted, start = 0, False, 0
    for i, char in enumerate(text):
        if char == "'":
            quoted = not quoted
        elif quoted:
            continue
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    pairs = []
    for item in items:
        if not item.strip():
            continue
        match = _ASSIGNMENT_RE.match(item)
        if match is None and pairs and pairs[-1][0] in continued:
            pairs[-1] = (pairs[-1][0], f"{pairs[-1][1]}, {item.strip()}")
            continue
        if match is None:
            raise ValueError(
                f"{filename}: {{{name}: ...}} holds {item.strip()!r}, not `column = expression`"
            )
        pairs.append((match.group(1), match.group(2)))
    return pairs


def statements_for(
    schema: str, filename: str = "queries.sql", package: str = PACKAGE, **identifiers: str
) -> Queries:
    """The named statements of ``filename`` for ``schema``, built once per process and
    shared: the parts that read one file (the claims and the operator's limits both read
    limits.sql) hold the same :class:`Queries` instead of a cache each. ``identifiers``
    fill the file's other identifier places (see :class:`Queries`)."""
    return _statements(schema, filename, package, tuple(sorted(identifiers.items())))


@functools.cache
def _statements(
    schema: str, filename: str, package: str, identifiers: tuple[tuple[str, str], ...]
) -> Queries:
    # One cache key per file and identifiers, however the caller spelled its arguments.
    return Queries(schema, filename, package=package, identifiers=dict(identifiers))


class Queries:
    """The named statements with the schema filled in, as plain strings.

    The schema goes through ``psycopg.sql.Identifier``; values are always bind parameters.
    Plain strings let psycopg prepare each statement once per connection. A file written
    for several tables (expiring_rows.sql: ``{table}``, ``{key}``) is given them as
    ``identifiers``, which go through ``psycopg.sql.Identifier`` too.
    """

    def __init__(
        self,
        schema: str,
        filename: str = "queries.sql",
        *,
        package: str = PACKAGE,
        identifiers: dict[str, str] | None = None,
    ) -> None:
        self.schema = schema
        names = {
            name: sql.Identifier(value)
            for name, value in {**(identifiers or {}), "schema": schema}.items()
        }
        self._text = {
            name: sql.SQL(text).format(**names).as_string(None)
            for name, text in load_queries(filename, package).items()
        }

    def __getitem__(self, name: str) -> str:
        return self._text[name]

    def __contains__(self, name: str) -> bool:
        return name in self._text

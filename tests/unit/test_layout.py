"""The package's rooms and who may import whom (docs/internals/layout.md draws them).

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dramatiq_pg_broker

PACKAGE = Path(dramatiq_pg_broker.__file__).parent
NAME = "dramatiq_pg_broker"

#: The rooms, lowest first: a room imports only the rooms before it (and itself).
ROOMS = (
    "base",
    "db",
    "history",
    "jobs",
    "control",
    "sending",
    "workflows",
    "attempt",
    "backends",
    "health",
    "cli",
)

#: The modules at the top of the package that are the base room: imported by every room,
#: importing no room.
BASE = {
    "errors",
    "events",
    "backoff",
    "forks",
    "service",
    "version",
    "config",
    "urls",
    "queue_rules",
}

#: The composition root and the package's entry points: they may import any room.
ROOT = {"__init__", "__main__", "broker", "contrib"}

#: The module paths release 0.1.0 had (and documented) of modules that moved into a room
#: since: each is the moved module under its old name. No other old path is kept: a module
#: written after 0.1.0 has one name.
ALIASES = {
    "current": "attempt.current",
    "embedded": "db.embedded",
    "messages": "sending.messages",
    "migrate": "db.migrate",
    "periodic": "history.periodic",
    "rate_limits": "backends.rate_limits",
    "results": "backends.results",
    "retention": "history.retention",
    "retries": "attempt.retries",
}

#: The most modules one import circle may hold.
MAX_CIRCLE = 3


def _modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def _resolve(name: str, modules) -> str | None:
    """The package's module that ``import name`` loads last: ``name`` itself, or the
    module that holds the attribute ``name`` names."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, every kind of import counted."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # ``from a import b``: the module a.b if there is one, else a.
                targets = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != NAME:
                    continue
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def room_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "root"
    first = parts[0]
    if first in ROOT or first in ALIASES:
        return "root"
    if first in BASE:
        return "base"
    assert first in ROOMS, f"{module}: in no room (add it to a room in tests/unit/test_layout.py)"
    return first


def test_the_largest_import_circle_is_small():
    largest = max(circles(import_graph()), key=len)
    assert len(largest) <= MAX_CIRCLE, largest


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(circles(graph), key=len)[-1] == ["a", "b", "c"]
    assert max(len(c) for c in circles({"a": {"b"}, "b": set()})) == 1


def test_every_import_is_counted():
    graph = import_graph()
    # Function-local (a lazy import) and TYPE_CHECKING imports are edges too.
    assert f"{NAME}.sending.async_sending" in graph[f"{NAME}.sending.sender"]
    assert f"{NAME}.attempt.completion" in graph[f"{NAME}.attempt.current"]
    assert f"{NAME}.db.handshake" in graph[f"{NAME}.db.core"]


def test_a_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, imported in import_graph().items():
        here = room_of(module)
        if here == "root":
            continue
        for target in imported:
            there = room_of(target)
            if there == "root":
                wrong.append((module, target))
            elif there != here and ROOMS.index(there) > ROOMS.index(here):
                wrong.append((module, target))
    assert wrong == []


def test_every_module_is_in_a_room():
    for module in import_graph():
        room_of(module)


def test_an_old_module_path_is_the_moved_module():
    import importlib

    for old, new in ALIASES.items():
        moved = importlib.import_module(f"{NAME}.{new}")
        assert importlib.import_module(f"{NAME}.{old}") is moved, old
        source = (PACKAGE / f"{old}.py").read_text("utf-8")
        assert "sys.modules[__name__] = _module" in source, old


def test_only_0_1_0s_module_paths_are_kept_and_nothing_of_ours_imports_them():
    """An old path is kept for applications only: the package and the admin side import
    the moved modules."""
    kept = {p.stem for p in PACKAGE.glob("*.py") if "sys.modules[__name__]" in p.read_text()}
    assert kept == set(ALIASES)
    old = {f"{NAME}.{name}" for name in ALIASES}
    offenders = [
        (module, target)
        for module, targets in import_graph().items()
        for target in targets & old
        if module not in old
    ]
    # The one exception: the package exports the decorator periodic, named as its module
    # (see __init__.py, and the test below).
    offenders.remove((NAME, f"{NAME}.periodic"))
    admin = PACKAGE.parent / "admin_api"
    for path in admin.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = {node.module, *names}
            elif isinstance(node, ast.Import):
                targets = {alias.name for alias in node.names}
            else:
                continue
            offenders += [(str(path.relative_to(admin)), t) for t in sorted(targets & old)]
    assert offenders == [], offenders


def test_the_modules_the_package_imports_by_name_exist():
    """The retention run imports its reclaimers by name (a room below may not import
    them): each is a module of the package under its one name, never an old path."""
    import importlib.util

    from dramatiq_pg_broker.history.retention import RECLAIMERS, STEPS

    for name in RECLAIMERS:
        assert importlib.util.find_spec(f"{NAME}.{name}") is not None, name
        assert name.split(".")[0] in ROOMS, name
    assert STEPS[-len(RECLAIMERS) :] == ("results", "rate_limits", "workers", "abort")


def test_importing_an_old_module_path_leaves_the_packages_names_alone():
    """``dramatiq_pg_broker.periodic`` is the decorator, even after its module's old path
    is imported (an import sets the package's attribute of that name to the module)."""
    import subprocess
    import sys

    code = (
        "import dramatiq_pg_broker.periodic\n"
        "from dramatiq_pg_broker import periodic, Schedule\n"
        "assert not isinstance(periodic, type(dramatiq_pg_broker)), periodic\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

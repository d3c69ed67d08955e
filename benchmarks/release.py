"""An earlier release of this broker, for ``python -m benchmarks.run --against REF``.

The git ref (a tag, a branch, a commit such as ``994d6c9``, the 0.1.0 release) is built the
way the upgrade test builds the previous release: ``git archive`` of the commit into a
folder, a virtual environment of its own, and ``pip install`` of that folder, whose
dependencies come from the package index (or pip's cache). The result is kept under
``benchmarks/results/.releases/<commit>/`` (git-ignored), so a second run reuses it.

The release's own ``benchmarks/`` may not exist or may differ: the run uses *this*
checkout's harness with the release's package. Its processes (clients and workers) run
the release's interpreter in a folder holding only a link to this checkout's
``benchmarks`` package, with ``PYTHONPATH`` set to that folder alone, so the
``dramatiq_pg_broker`` they import is the release's. Its schema is migrated by its own
``migrate`` command.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .harness import ROOT, BenchError, Variant

HERE = Path(__file__).resolve().parent
#: Where built releases are kept (``benchmarks/results/`` is git-ignored). A hidden folder:
#: setuptools' package finder (``find_namespace:`` in setup.cfg) walks every folder of the
#: checkout whose name has no dot, and building the package (``python -m build``, as the
#: base-install test does) spent minutes walking a release's virtualenv there.
CACHE = HERE / "results" / ".releases"
#: The workloads an earlier release takes part in. The others load or read this
#: checkout's schema (history partitions, the ``all_jobs`` view, its migrations) or
#: depend on a setting of this checkout (the idle worker's statement count).
WORKLOADS = (
    "enqueue", "enqueue8", "bulk", "drain", "latency", "memory", "life", "notify", "workflow",
)  # fmt: skip
#: The name of the release's variant in the results (``postgres-ref@tcp``).
NAME = "postgres-ref"


@dataclass(frozen=True)
class Release:
    """A built release: its commit, version, interpreter and code folder."""

    ref: str
    commit: str
    version: str
    python: Path
    code: Path

    def variant(self, schema: str) -> Variant:
        """The release as a broker of the run, events on (as ``postgres``)."""
        return Variant(
            NAME,
            f"postgres {self.version} ({self.ref})",
            "postgres",
            {"DRAMATIQ_PG_EVENTS": "1"},
            python=str(self.python),
            code=str(self.code),
            schema=schema,
        )

    def migrate(self, url: str, schema: str) -> None:
        """Create ``schema`` afresh with the release's own migrations."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        env = {**os.environ, "DRAMATIQ_PG_URL": url, "DRAMATIQ_PG_SCHEMA": schema,
               "PYTHONPATH": str(self.code)}  # fmt: skip
        done = subprocess.run(
            [str(self.python), "-m", "dramatiq_pg_broker", "migrate"],
            cwd=self.code, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if done.returncode != 0:
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
            raise BenchError(f"the release's migrate failed: {tail}")


def _git(*args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=text, timeout=120)


def build(ref: str, *, log=print) -> Release:
    """The release at git ``ref``, built once and then reused (see the module docstring).

    Raises:
      BenchError: the ref is not a commit of this repository, or the build failed.
    """
    found = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if found.returncode != 0:
        raise BenchError(
            f"--against {ref}: not a commit of this repository (a shallow clone may need "
            "git fetch --unshallow)"
        )
    commit = found.stdout.strip()
    home = CACHE / commit
    python = home / "venv" / "bin" / "python"
    code = home / "code"
    marker = home / "built.json"
    if not (marker.exists() and python.exists()):
        log(f"Building {ref} ({commit[:12]}) into {home} (once; later runs reuse it)...")
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        archive = _git("archive", "--format=tar", commit, text=False)
        if archive.returncode != 0:
            raise BenchError(f"git archive {commit[:12]} failed")
        source = home / "source"
        # The archive is this repository's own; "data" is the safe filter where it exists.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(source, **safe)  # noqa: S202
        _run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], "venv")
        # This environment's pip installs into the release's (pip's --python).
        _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet",
              "--python", str(python), "install", str(source)], "pip install")  # fmt: skip
        version = _run(
            [str(python), "-c", "import dramatiq_pg_broker as p; print(p.__version__)"],
            "importing the release", cwd=home, env={**os.environ, "PYTHONPATH": ""},
        ).stdout.strip()  # fmt: skip
        marker.write_text(json.dumps({"ref": ref, "commit": commit, "version": version}))
    version = json.loads(marker.read_text())["version"]
    # The code folder links to this checkout's benchmarks, wherever the checkout is now.
    code.mkdir(exist_ok=True)
    link = code / "benchmarks"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(HERE, target_is_directory=True)
    return Release(ref, commit, version, python, code)


def _run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, **kwargs)
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise BenchError(f"building the release: {what} failed: {tail}")
    return done

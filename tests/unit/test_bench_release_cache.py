"""The benchmarks keep the earlier releases they build where building this package does
not look: setuptools' package finder (``find_namespace:`` in setup.cfg) walks every folder
of the checkout whose name has no dot, and a release's virtualenv under
``benchmarks/results/releases/`` once made ``python -m build`` (the base-install test)
run for minutes, until the test timed out."""

from __future__ import annotations

from benchmarks.harness import ROOT
from benchmarks.release import CACHE


def test_built_releases_live_in_a_folder_the_package_finder_skips():
    parts = CACHE.relative_to(ROOT).parts
    assert any(part.startswith(".") for part in parts), parts

"""The test clusters' ports are reserved across the test processes of a machine: a port
whose cluster is stopped (an outage being timed) is not handed to a test beside it, so
the cluster comes back where its clients wait for it."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e import clusters

OTHER_PROCESS = """
import sys
from tests.e2e import clusters
print(clusters.free_ports(1, [int(sys.argv[1])]))
"""


def _free_in_another_process(port: int) -> str:
    return subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, str(port)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()


def test_a_port_held_by_one_process_is_not_free_for_another_until_released():
    ports = clusters.free_ports(1)
    assert ports is not None
    (port,) = ports
    try:
        # Nothing listens on it (a stopped cluster), yet it is this process's.
        assert _free_in_another_process(port) == "None"
        assert clusters.free_ports(1, [port]) is None
    finally:
        clusters.release(port)
    assert _free_in_another_process(port) == f"[{port}]"


def test_a_released_port_leaves_no_file_and_the_last_one_no_folder(monkeypatch, tmp_path):
    """A green run leaves nothing in the temporary folder: each port's lock file goes when
    its port is given back, the folder with the last of them."""
    folder = tmp_path / "ports"
    monkeypatch.setattr(clusters, "RESERVATIONS", folder)
    ports = clusters.free_ports(2)
    assert ports is not None
    try:
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"{p}.lock" for p in ports)
        clusters.release(ports[0])
        assert [p.name for p in folder.iterdir()] == [f"{ports[1]}.lock"]
        # A file left by a process that ended without giving its port back is taken over.
        (folder / f"{ports[0]}.lock").touch()
        assert clusters.free_ports(1, [ports[0]]) == [ports[0]]
        clusters.release(ports[0])
    finally:
        clusters.release(ports[1])
    assert not folder.exists()

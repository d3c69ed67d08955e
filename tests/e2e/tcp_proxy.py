"""A TCP forwarder that stands for a virtual IP or a DNS name a failover moves: each new
connection goes to the server it points at when the connection is made; connections
already made stay where they are."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    """Forwards 127.0.0.1:``port`` (a free port) to 127.0.0.1:``target``.

    Parameters:
      target(int): the port new connections go to (see :meth:`point_to`).
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port: int = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def point_to(self, target: int) -> None:
        """Send new connections to ``target`` from now on."""
        self.target = target

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

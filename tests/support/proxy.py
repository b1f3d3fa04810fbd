"""A TCP proxy the tests can cut, to make a real service unreachable without stopping it.

Stopping the shared PostgreSQL, Redis or RabbitMQ would disturb every other test run on the
machine; cutting a proxy in front of it gives the client the same broken connections.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit


class TCPProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` drops every connection and refuses
    new ones until ``restore()``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._up = threading.Event()
        self._up.set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        userinfo = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{self.port}"))

    def cut(self) -> None:
        self._up.clear()
        with self._lock:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._connections.clear()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._connections.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._connections.discard(conn)


@contextlib.contextmanager
def tcp_proxy(url: str, default_port: int) -> Iterator[TCPProxy]:
    """A proxy in front of the service at ``url``, closed on exit."""
    parts = urlsplit(url)
    proxy = TCPProxy(parts.hostname or "127.0.0.1", parts.port or default_port)
    try:
        yield proxy
    finally:
        proxy.close()

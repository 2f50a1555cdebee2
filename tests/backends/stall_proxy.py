"""A loopback TCP proxy that can stop forwarding: a half-open connection on demand.

The client's connection to the proxy stays open and its kernel keeps accepting the bytes the
client sends, but nothing reaches the server and nothing comes back -- what a client sees when
a NAT drops its state, or the server's host freezes. Neither TCP keepalives nor a server-side
timeout can end that wait; only the client's own deadline can. The proxy runs in threads of
the test process, listens on 127.0.0.1 on a free port of its own, and closes everything it
opened on ``close()``.
"""

from __future__ import annotations

import select
import socket
import threading


class StallingProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, stalled: bool = False) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        if not stalled:
            self._forwarding.set()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="stall-proxy-accept", daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> "StallingProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stall(self) -> None:
        """From now on, forward nothing in either direction (connections stay open)."""
        self._forwarding.clear()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.close()
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], 0.05)
                if not ready:
                    continue
                client, _ = self._listener.accept()
            except (OSError, ValueError):
                return
            self._track(client)
            thread = threading.Thread(target=self._serve, args=(client,), name="stall-proxy-pipe", daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        # A stalled proxy accepts but never even dials the server: connects hang at the handshake.
        while not self._forwarding.wait(0.05):
            if self._closing.is_set():
                return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self._track(server)
        try:
            self._pump({client: server, server: client})
        finally:  # one side hung up: let the other see it too
            for sock in (client, server):
                try:
                    sock.close()
                except OSError:
                    pass

    def _pump(self, peer: dict[socket.socket, socket.socket]) -> None:
        while not self._closing.is_set():
            if not self._forwarding.is_set():
                self._closing.wait(0.05)  # hold everything: the bytes stay unread in kernel buffers
                continue
            try:
                ready, _, _ = select.select(list(peer), [], [], 0.05)
            except (OSError, ValueError):
                return
            for sock in ready:
                try:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if self._forwarding.is_set():
                        peer[sock].sendall(data)
                except OSError:
                    return

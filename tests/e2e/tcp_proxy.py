"""Loopback TCP proxies: `CuttingProxy` counts the bytes a client sends and can cut its connection mid-stream.

`CuttingProxy(upstream_port, cut_after=N)` forwards every connection to the server; once N client bytes
have gone through in total it closes that connection abruptly (both sides), once, as a dropped network
link would. `sent` is the count of client bytes forwarded, so a test can tell how much a resume re-sent.
Setting `silent` makes it swallow every byte both ways without closing anything, as a vanished host or a
paused machine would (until the server side closes). `FailoverProxy(ports)` sends each connection to the
first of several servers that accepts it.
"""

from __future__ import annotations

import socket
import threading


class CuttingProxy:
    def __init__(self, upstream_port: int, cut_after: int | None = None) -> None:
        self.upstream_port, self.cut_after = upstream_port, cut_after
        self.sent, self.cuts = 0, 0
        self.silent, self.swallowed = False, 0  # client bytes dropped while silent
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump_up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(server, client), daemon=True).start()

    def _pump_up(self, client: socket.socket, server: socket.socket) -> None:
        while data := _recv(client):
            if self.silent:
                self.swallowed += len(data)
                continue
            with self._lock:
                cut = self.cut_after is not None and self.cuts == 0 and self.sent + len(data) >= self.cut_after
                if cut:
                    data = data[: self.cut_after - self.sent]
                    self.cuts += 1
                self.sent += len(data)
            server.sendall(data)
            if cut:
                break
        for sock in (client, server):
            _shut(sock)

    def _pump_down(self, server: socket.socket, client: socket.socket) -> None:
        while data := _recv(server):
            if self.silent:
                continue
            try:
                client.sendall(data)
            except OSError:
                break
        for sock in (client, server):
            _shut(sock)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class FailoverProxy:
    """A load balancer in miniature: each new connection goes to the first upstream port that accepts it,
    in the given order; a connection whose upstream dies is closed, as a balancer would. `routed[port]`
    counts the connections each upstream took."""

    def __init__(self, upstream_ports: list[int]) -> None:
        self.upstream_ports = upstream_ports
        self.routed = dict.fromkeys(upstream_ports, 0)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = self._connect()
            if server is None:
                _shut(client)
                continue
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def _connect(self) -> socket.socket | None:
        for port in self.upstream_ports:
            try:
                server = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                continue
            server.settimeout(None)
            self.routed[port] += 1
            return server
        return None


def _pump(src: socket.socket, dst: socket.socket) -> None:
    while data := _recv(src):
        try:
            dst.sendall(data)
        except OSError:
            break
    for sock in (src, dst):
        _shut(sock)

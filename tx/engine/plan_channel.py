"""The leader's line to its followers: one TCP connection per follower, length-prefixed frames, heartbeats.

Process 0 listens (`Leader.listen`) and every other process connects (`Follower.connect`) and introduces
itself with its process id and its fingerprint (`tx.engine.multihost.fingerprint`); the leader compares
the fingerprints before anything runs and answers each follower "ok" or the difference, so mismatched
processes are refused at start. Afterwards the leader sends each engine call to every follower
(`Leader.send`), and each follower sends a heartbeat every `HEARTBEAT_S` from its own thread. A follower
whose connection closes (it died) or that sends nothing for `timeout_s` (it hangs) is reported to the
leader's `on_lost` from the watcher thread; a follower whose leader is gone is told by `receive` raising
`LeaderLost`. Frames are pickles: the channel joins processes of one deployment on a private network,
never a client (docs/deploy.md).
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tx.engine")
HEARTBEAT_S = 0.5
_HEADER = struct.Struct("!Q")


class LeaderLost(Exception):
    """The leader's connection closed or broke: this follower cannot go on."""


def send_frame(sock: socket.socket, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> Any:
    """The next frame's message; `ConnectionError` when the peer closed the connection."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Leader:
    """Process 0's end: `followers` = process id -> its connection, once `accept` has returned."""

    def __init__(self, server: socket.socket, expected: int) -> None:
        self.server, self.expected = server, expected
        self.followers: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        self._lost = threading.Event()  # set by a watcher just before it reports a lost follower

    @classmethod
    def listen(cls, port: int, expected: int) -> Leader:
        server = socket.create_server(("", port), reuse_port=False)
        return cls(server, expected)

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    def accept(self, own: dict[str, str], timeout_s: float) -> None:
        """Wait for every follower's introduction; refuse them all (and raise) when a fingerprint differs."""
        self.server.settimeout(timeout_s)
        hellos: dict[int, dict[str, str]] = {}
        try:
            while len(self.followers) < self.expected:
                sock, _ = self.server.accept()
                sock.settimeout(timeout_s)
                _, process_id, theirs = recv_frame(sock)
                self.followers[int(process_id)], hellos[int(process_id)] = sock, theirs
        except TimeoutError as err:
            missing = self.expected - len(self.followers)
            raise RuntimeError(f"{missing} follower process(es) did not connect within {timeout_s:.0f} s") from err
        problems = [p for pid, theirs in sorted(hellos.items()) if (p := differences(own, theirs, pid))]
        for sock in self.followers.values():
            send_frame(sock, ("refused", "; ".join(problems)) if problems else ("ok",))
        if problems:
            raise RuntimeError("the engine processes differ: " + "; ".join(problems))

    def send(self, message: Any) -> None:
        """Send one message to every follower (from the engine thread)."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for sock in self.followers.values():
                sock.sendall(_HEADER.pack(len(body)) + body)

    def watch(self, timeout_s: float, on_lost: Callable[[str], None]) -> None:
        """Watch every follower's heartbeats on its own thread; `on_lost(message)` once one stops."""
        for process_id, sock in self.followers.items():
            sock.settimeout(timeout_s)
            args = (process_id, sock, timeout_s, on_lost)
            threading.Thread(target=self._watch_one, args=args, name=f"tx-watch-{process_id}", daemon=True).start()

    def wait_lost(self, timeout_s: float) -> bool:
        """True once a watcher has found a follower lost (waiting up to `timeout_s` for that)."""
        return self._lost.wait(timeout_s)

    def _watch_one(self, process_id: int, sock: socket.socket, timeout_s: float, on_lost: Callable) -> None:
        who = f"engine process {process_id} of {self.expected + 1}"
        try:
            while True:
                recv_frame(sock)
        except TimeoutError:
            reason = f"{who} stopped answering (no heartbeat for {timeout_s:g} s)"
        except (ConnectionError, OSError) as err:
            reason = f"{who} is gone (its connection closed: {err})"
        self._lost.set()
        on_lost(reason)


class Follower:
    """A follower's end: messages from the leader in order through `receive`; heartbeats go on a thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._inbox: queue.Queue[Any] = queue.Queue()

    @classmethod
    def connect(cls, address: str, process_id: int, own: dict[str, str], timeout_s: float) -> Follower:
        """Connect to the leader (retrying until `timeout_s`: it may still be loading), introduce this
        process and wait for its verdict."""
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        send_frame(sock, ("hello", process_id, own))
        sock.settimeout(timeout_s)
        verdict = recv_frame(sock)
        if verdict[0] != "ok":
            raise RuntimeError(f"the leader refused this process: {verdict[1]}")
        sock.settimeout(None)
        return cls(sock)

    def start(self) -> None:
        threading.Thread(target=self._read, name="tx-follow-read", daemon=True).start()
        threading.Thread(target=self._beat, name="tx-follow-beat", daemon=True).start()

    def receive(self) -> Any:
        message = self._inbox.get()
        if isinstance(message, LeaderLost):
            raise message
        return message

    def _read(self) -> None:
        try:
            while True:
                self._inbox.put(recv_frame(self.sock))
        except (ConnectionError, OSError) as err:
            self._inbox.put(LeaderLost(f"the leader (process 0) is gone: {err}"))

    def _beat(self) -> None:
        try:
            while True:
                send_frame(self.sock, ("beat",))
                time.sleep(HEARTBEAT_S)
        except OSError:
            return  # the reader reports the closed connection


def differences(own: dict[str, str], theirs: dict[str, str], process_id: int) -> str:
    """'' when two fingerprints agree; else the fields that differ, each with both values."""
    keys = sorted(set(own) | set(theirs))
    diff = [f"{k}: process 0 has {own.get(k)!r}, process {process_id} has {theirs.get(k)!r}" for k in keys
            if own.get(k) != theirs.get(k)]  # fmt: skip
    return ", ".join(diff)

"""The leader/follower seam without JAX's runtime: the plan channel over loopback, fake runners on both ends.

The e2e test (`tests/e2e/test_multihost.py`) runs real processes; these check the pieces it rests on in
milliseconds: a follower makes exactly the leader's calls in order, a seedless sample is seeded once for
all, mismatched processes are refused naming the difference, a silent follower is reported.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tx.engine.loop import Completion
from tx.engine.multihost import LeaderRunner, follow
from tx.engine.plan_channel import Follower, Leader, send_frame
from tx.protocol import RequestError, SampleRequest, SamplingParams, WorkItem

OWN = {"code": "abc", "engine flags": "EngineConfig(fsdp_size=2)"}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submit(self, items) -> None:  # noqa: ANN001
        self.calls.append(("submit", [(i.future_id, i.payload.params.seed) for i in items]))

    def step(self) -> list[Completion]:
        self.calls.append(("step",))
        return []

    def discard(self, future_ids) -> None:  # noqa: ANN001
        self.calls.append(("discard", list(future_ids)))

    def idle(self) -> bool:
        return True


def pair(theirs: dict[str, str] = OWN) -> tuple[Leader, Follower]:
    leader = Leader.listen(0, 1)
    joined: dict[str, Follower] = {}
    thread = threading.Thread(target=lambda: joined.setdefault("f", connect(leader, theirs)))
    thread.start()
    try:
        leader.accept(OWN, timeout_s=10)
    finally:
        thread.join(10)
    return leader, joined["f"]


def connect(leader: Leader, fingerprint: dict[str, str]) -> Follower:
    try:
        return Follower.connect(f"127.0.0.1:{leader.port}", 1, fingerprint, timeout_s=10)
    except RuntimeError as err:
        return err  # type: ignore[return-value]


def sample(future_id: str, seed: int | None) -> WorkItem:
    req = SampleRequest([1, 2], 1, SamplingParams(max_tokens=2, seed=seed), "m")
    return WorkItem(future_id, "sample", "s", req, 0.0)


def test_a_follower_makes_the_leaders_calls_in_order_with_the_seeds_drawn_once() -> None:
    channel, follower = pair()
    follower.start()
    mine, theirs = Recorder(), Recorder()
    thread = threading.Thread(target=follow, args=(theirs, follower), daemon=True)
    thread.start()
    leader = LeaderRunner(mine, channel)
    leader.submit([sample("1", None), sample("2", 5)])
    leader.step()
    leader.discard(["1"])
    leader.step()
    leader.close()
    thread.join(10)
    assert not thread.is_alive() and theirs.calls == mine.calls
    (_, seeded), *_ = mine.calls
    assert seeded[0][1] is not None and seeded[1] == ("2", 5)  # drawn on the leader, sent to the follower
    assert leader.broadcasts == 5


def test_a_mismatched_process_is_refused_naming_the_difference() -> None:
    other = {**OWN, "engine flags": "EngineConfig(fsdp_size=4)"}
    with pytest.raises(RuntimeError, match=r"engine flags: process 0 has .*fsdp_size=2.*process 1 has .*fsdp_size=4"):
        pair(other)


def test_a_silent_follower_is_reported_within_the_timeout() -> None:
    leader = Leader.listen(0, 1)
    sock = socket.create_connection(("127.0.0.1", leader.port))
    send_frame(sock, ("hello", 1, OWN))  # then never a heartbeat: a hung process
    leader.accept(OWN, timeout_s=10)
    lost: list[str] = []
    start = time.monotonic()
    leader.watch(0.5, lost.append)
    while not lost and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert lost == ["engine process 1 of 2 stopped answering (no heartbeat for 0.5 s)"]
    assert time.monotonic() - start < 5  # reported after the 0.5 s timeout, not the 10 s the loop allows
    sock.close()


class FailingStep(Recorder):
    """A step whose collective fails: it first runs `before` (a follower dying), then fails item "1"."""

    def __init__(self, before) -> None:  # noqa: ANN001
        super().__init__()
        self.before = before

    def step(self) -> list[Completion]:
        self.before()
        return [Completion("1", RequestError("JaxRuntimeError: Gloo AllGather failed: reset by peer", "server"))]


def silent_follower(leader: Leader) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", leader.port))
    send_frame(sock, ("hello", 1, OWN))
    leader.accept(OWN, timeout_s=10)
    return sock


def test_a_step_failed_by_a_dead_follower_leaves_its_work_to_the_watcher() -> None:
    """The collective's error must not reach the work before the watcher's reason does (CI saw the race)."""
    channel = Leader.listen(0, 1)
    sock = silent_follower(channel)
    lost: list[str] = []
    channel.watch(30, lost.append)
    leader = LeaderRunner(FailingStep(sock.close), channel, verdict_s=30)
    returned: list[list[Completion]] = []
    thread = threading.Thread(target=lambda: returned.append(leader.step()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(0.5)
    assert lost and "engine process 1 of 2 is gone" in lost[0]
    assert thread.is_alive() and not returned  # held until the watcher's exit


def test_a_step_failed_with_every_follower_alive_returns_its_failures() -> None:
    channel = Leader.listen(0, 1)
    sock = silent_follower(channel)
    lost: list[str] = []
    channel.watch(30, lost.append)
    leader = LeaderRunner(FailingStep(lambda: None), channel, verdict_s=0.2)
    (failed,) = leader.step()
    assert failed.future_id == "1" and isinstance(failed.result, RequestError) and not lost
    sock.close()

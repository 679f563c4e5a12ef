"""The upload store on real files: chunks kept only when their sha256 matches, resume from the verified
offset after a restart (an unverified tail cut off), publication by one rename after validation, hostile
names refused twice, another owner's uploads invisible, deletion."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tx.names import BadName
from tx.upload_store import MAX_CHUNK_BYTES, MAX_FILES, STALE_AFTER_S, FileSpec, UploadError, UploadStore, check_files

OWNER, OTHER = "a" * 24, "b" * 24
CONFIG = json.dumps({"architectures": ["Qwen3ForCausalLM"]}).encode()
WEIGHTS = bytes(range(256)) * 40


def spec(name: str, data: bytes) -> FileSpec:
    return FileSpec(name, len(data), hashlib.sha256(data).hexdigest())


FILES = {"config.json": CONFIG, "model.safetensors": WEIGHTS}


def facts(_model_dir: Path) -> dict:
    return {"architecture": "Qwen3ForCausalLM", "max_context_length": 128}


def send(store: UploadStore, file: str, data: bytes, offset: int, owner: str = OWNER) -> None:
    with store.chunk(owner, "m", file, offset, len(data)) as writer:
        writer.write(data)
        writer.commit(hashlib.sha256(data).hexdigest())


def begin(store: UploadStore, owner: str = OWNER) -> dict[str, int]:
    return store.begin(owner, "m", [spec(n, d) for n, d in FILES.items()])


def send_all(store: UploadStore, owner: str = OWNER) -> None:
    for name, data in FILES.items():
        held = store.received(owner, "m")[name]  # type: ignore[index]
        if held < len(data):
            send(store, name, data[held:], held, owner)


def test_round_trip_publishes_only_after_validation(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    assert begin(store) == {"config.json": 0, "model.safetensors": 0}
    send_all(store)
    assert store.find_upload(OWNER, "upload:m") is None and store.uploads(OWNER) == []
    info = store.finish(OWNER, "m", facts)
    model_dir = store.find_upload(OWNER, "upload:m")
    assert model_dir is not None and (model_dir / "model.safetensors").read_bytes() == WEIGHTS
    assert info.size_bytes == len(CONFIG) + len(WEIGHTS) and store.list_uploads(OWNER) == ["upload:m"]
    assert store.find_upload(OTHER, "upload:m") is None and store.uploads(OTHER) == []
    assert store.find_upload(OWNER, "m") is None  # not an upload string
    with pytest.raises(UploadError, match="already exists"):
        begin(store)


def test_a_bad_chunk_leaves_nothing_and_a_restart_resumes_at_the_verified_offset(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    send(store, "model.safetensors", WEIGHTS[:4000], 0)
    with pytest.raises(UploadError, match="does not match its X-Chunk-Sha256"):
        with store.chunk(OWNER, "m", "model.safetensors", 4000, 100) as writer:
            writer.write(WEIGHTS[4000:4100])
            writer.commit("0" * 64)
    with pytest.raises(UploadError, match="longer than its declared 10 bytes"):
        with store.chunk(OWNER, "m", "model.safetensors", 4000, 10) as writer:
            writer.write(WEIGHTS[4000:4011])
    part = tmp_path / OWNER / ".staging" / "m" / "model" / "model.safetensors"
    assert part.stat().st_size == 4000
    with open(part, "ab") as f:  # a server killed mid-chunk leaves unverified bytes behind
        f.write(b"garbage" * 2000)  # longer than the rest of the file
    restarted = UploadStore(tmp_path, 10**6)
    assert restarted.received(OWNER, "m") == {"config.json": 0, "model.safetensors": 4000}
    with pytest.raises(UploadError, match="holds 4000 bytes, the chunk starts at 3000") as err:
        send(restarted, "model.safetensors", WEIGHTS[3000:4000], 3000)
    assert err.value.status == 416
    send_all(restarted)
    restarted.finish(OWNER, "m", facts)
    assert (restarted.find_upload(OWNER, "upload:m") / "model.safetensors").read_bytes() == WEIGHTS  # type: ignore[operator]


def test_an_incomplete_or_refused_upload_is_never_published(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    send(store, "config.json", CONFIG, 0)
    with pytest.raises(UploadError, match="'model.safetensors' has 0 of 10240 bytes"):
        store.finish(OWNER, "m", facts)
    send_all(store)

    def refuse(_model_dir: Path) -> dict:
        raise ValueError("tensor 'x' has shape (3,), expected (4,)")

    with pytest.raises(UploadError, match=r"upload 'm' refused: tensor 'x' has shape"):
        store.finish(OWNER, "m", refuse)
    assert store.received(OWNER, "m") is None and store.find_upload(OWNER, "upload:m") is None


def test_a_file_changed_under_its_declared_sha256_is_sent_again(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    store.begin(OWNER, "m", [spec("config.json", CONFIG), FileSpec("model.safetensors", len(WEIGHTS), "f" * 64)])
    send_all(store)
    with pytest.raises(UploadError, match="'model.safetensors' does not match its sha256"):
        store.finish(OWNER, "m", facts)
    assert store.received(OWNER, "m") == {"config.json": len(CONFIG), "model.safetensors": 0}


def test_declarations_are_checked(tmp_path):
    store = UploadStore(tmp_path, 10_000)
    with pytest.raises(UploadError, match=r"over this server's --max-upload-gb 1e-05") as err:
        begin(store)
    assert err.value.status == 413
    roomy = UploadStore(tmp_path, 10**6)
    for files, message in [
        ([spec("model.safetensors", WEIGHTS)], "needs config.json"),
        ([spec("config.json", CONFIG)] * 2, "unique"),
        ([spec("config.json", CONFIG), FileSpec("model.safetensors", 1, "xyz")], "64 lowercase hex"),
        ([], "1-1024 files"),
    ]:
        with pytest.raises(UploadError, match=message):
            roomy.begin(OWNER, "m", files)
    with pytest.raises(UploadError, match=f"1-{MAX_CHUNK_BYTES} bytes"):
        begin(roomy)
        roomy.chunk(OWNER, "m", "config.json", 0, len(CONFIG) + 1).__enter__()


@pytest.mark.parametrize("name", ["..", ".staging", "../x", "a/b", "", "x" * 129])
def test_hostile_names_never_become_paths(tmp_path, name):
    store = UploadStore(tmp_path / "uploads", 10**6)
    with pytest.raises(BadName):
        store.begin(OWNER, name, [spec(n, d) for n, d in FILES.items()])
    with pytest.raises(BadName):
        store.begin(name or ".", "m", [spec(n, d) for n, d in FILES.items()])
    with pytest.raises(BadName):
        store.begin(OWNER, "m", [spec(name, CONFIG), spec("config.json", CONFIG), spec("m.safetensors", WEIGHTS)])
    assert store.find_upload(OWNER, f"upload:{name}") is None and store.find_upload(name, "upload:m") is None
    assert not (tmp_path / "x").exists() and not (tmp_path / "uploads" / OWNER / ".staging" / "m" / "model").exists()


def test_delete_removes_complete_and_partial_uploads_of_their_owner_only(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    send_all(store)
    store.finish(OWNER, "m", facts)
    begin(store, OTHER)
    assert not store.delete(OWNER, "other-name")
    assert store.delete(OWNER, "m") and store.find_upload(OWNER, "upload:m") is None
    assert not (tmp_path / OWNER / "m").exists() and store.received(OTHER, "m") is not None
    assert store.delete(OTHER, "m") and store.received(OTHER, "m") is None


def test_one_request_at_a_time_per_upload(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    with store.chunk(OWNER, "m", "config.json", 0, len(CONFIG)) as writer:
        with pytest.raises(UploadError, match="busy") as err:
            store.delete(OWNER, "m")
        assert err.value.status == 423
        writer.write(CONFIG)
        writer.commit(hashlib.sha256(CONFIG).hexdigest())
    assert store.received(OWNER, "m") == {"config.json": len(CONFIG), "model.safetensors": 0}


HOLD_A_CHUNK = """
import hashlib, sys
from pathlib import Path
from tx.upload_store import UploadStore
store, data = UploadStore(Path(sys.argv[1]), 10**6), sys.argv[2].encode()
with store.chunk(sys.argv[3], "m", "config.json", 0, len(data)) as writer:
    writer.write(data)
    print("holding", flush=True)
    sys.stdin.readline()
    writer.commit(hashlib.sha256(data).hexdigest())
"""


def test_another_process_holding_the_upload_is_refused_until_it_is_done(tmp_path):
    """`--role api` processes share the data directory: a chunk write in one process excludes the same
    upload's chunk writes and publication in another (their bytes would interleave)."""
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_CHUNK, str(tmp_path), CONFIG.decode(), OWNER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "holding\n"
        for attempt in (lambda: send(store, "config.json", CONFIG, 0), lambda: store.finish(OWNER, "m", facts)):
            with pytest.raises(UploadError, match="busy") as err:
                attempt()
            assert err.value.status == 423
        begin(store, OTHER)
        send(store, "model.safetensors", WEIGHTS, 0, OTHER)  # another owner's upload of that name goes on
    finally:
        child.communicate("go\n", timeout=60)
    assert child.returncode == 0
    assert store.received(OWNER, "m") == {"config.json": len(CONFIG), "model.safetensors": 0}
    send(store, "model.safetensors", WEIGHTS, 0)
    assert store.finish(OWNER, "m", facts).size_bytes == len(CONFIG) + len(WEIGHTS)


def test_a_partial_upload_abandoned_for_a_week_is_removed_at_start(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    begin(store, OTHER)
    week_ago = time.time() - 7 * 86400 - 60
    os.utime(tmp_path / OWNER / ".staging" / "m" / "state.json", (week_ago, week_ago))
    restarted = UploadStore(tmp_path, 10**6)
    assert restarted.received(OWNER, "m") is None and not (tmp_path / OWNER / ".staging" / "m").exists()
    assert restarted.received(OTHER, "m") == {"config.json": 0, "model.safetensors": 0}


def _refused(status: int, fragment: str, call, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UploadError, match=fragment) as err:
        call(*args)
    assert err.value.status == status, err.value


def test_declaration_edges_and_their_statuses():
    """Each limit of a declaration at its edge, and the HTTP status each refusal carries."""
    weights = [spec("config.json", CONFIG), spec("model.safetensors", WEIGHTS)]
    total = len(CONFIG) + len(WEIGHTS)
    assert check_files(weights, total) == total  # exactly the limit
    _refused(413, r"over this server's --max-upload-gb 1e-06", check_files, weights, 1000)
    many = weights + [FileSpec(f"f{i}", 0, "0" * 64) for i in range(MAX_FILES - 2)]
    assert check_files(many, total) == total  # 1024 files, empty ones allowed
    _refused(400, "1-1024 files, got 1025", check_files, [*many, FileSpec("one-more", 0, "0" * 64)], total)
    _refused(400, "size must be an integer >= 0", check_files, [*weights, FileSpec("neg", -1, "0" * 64)], total)
    _refused(400, "64 lowercase hex", check_files, [*weights, FileSpec("up", 1, "A" * 64)], total)
    _refused(400, "unique", check_files, [*weights, weights[0]], total)
    _refused(400, "needs config.json", check_files, weights[1:], total)
    _refused(400, "needs config.json and .safetensors", check_files, weights[:1], total)
    assert MAX_CHUNK_BYTES == 8 << 20 and STALE_AFTER_S == 7 * 86400


def test_chunk_edges_and_operation_statuses(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    _refused(404, "no upload 'm' in progress", store.finish, OWNER, "m", facts)
    begin(store)
    for offset, length in [(0, 0), (0, len(CONFIG) + 1)]:
        _refused(
            400, "bytes within", lambda o, n: store.chunk(OWNER, "m", "config.json", o, n).__enter__(), offset, length
        )
    _refused(404, "has no file 'nope' in progress", lambda: store.chunk(OWNER, "m", "nope", 0, 1).__enter__())
    send(store, "config.json", CONFIG[:1], 0)  # one byte
    send(store, "config.json", CONFIG[1:], 1)  # the rest: ends exactly at the declared size
    with pytest.raises(UploadError, match="chunk ended after 3 of 4 bytes") as err:
        with store.chunk(OWNER, "m", "model.safetensors", 0, 4) as writer:
            writer.write(WEIGHTS[:3])
            writer.commit(hashlib.sha256(WEIGHTS[:3]).hexdigest())
    assert err.value.status == 400
    send_all(store)
    store.finish(OWNER, "m", facts)
    _refused(409, "upload 'm' already exists", begin, store)
    assert store.delete(OWNER, "m") and not store.delete(OWNER, "m")


def test_a_partial_upload_touched_within_the_week_stays(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    almost = time.time() - STALE_AFTER_S + 60
    os.utime(tmp_path / OWNER / ".staging" / "m" / "state.json", (almost, almost))
    assert UploadStore(tmp_path, 10**6).received(OWNER, "m") == {"config.json": 0, "model.safetensors": 0}


def test_resuming_keeps_only_files_declared_alike(tmp_path):
    """A second `begin` keeps the verified bytes of each file declared exactly as before; a changed file starts
    over (its partial bytes go), a new one starts at 0, and an empty one exists at once."""
    store = UploadStore(tmp_path, 10**6)
    begin(store)
    send(store, "model.safetensors", WEIGHTS[:4000], 0)
    send(store, "config.json", CONFIG, 0)
    model = tmp_path / OWNER / ".staging" / "m" / "model"
    changed = FileSpec("config.json", len(CONFIG), "0" * 64)
    resumed = store.begin(OWNER, "m", [changed, spec("model.safetensors", WEIGHTS), spec("empty.txt", b"")])
    assert resumed == {"config.json": 0, "model.safetensors": 4000, "empty.txt": 0}
    assert not (model / "config.json").exists() and (model / "model.safetensors").stat().st_size == 4000
    assert (model / "empty.txt").read_bytes() == b""
    assert {spec("a", b"x"), spec("a", b"x")} == {spec("a", b"x")}  # declarations are values


def test_deletions_one_after_another_and_private_lock_files(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    for name in ("first", "second"):  # the second finds the first's .trash folder in place
        store.begin(OWNER, name, [spec(n, d) for n, d in FILES.items()])
        assert store.delete(OWNER, name) and store.received(OWNER, name) is None
    locks = list((tmp_path / OWNER / ".locks").iterdir())
    assert locks and all(lock.stat().st_mode & 0o777 == 0o600 for lock in locks)


def test_refused_chunks_and_uploads_are_client_errors(tmp_path):
    store = UploadStore(tmp_path, 10**6)
    store.begin(OWNER, "m", [spec("config.json", CONFIG), FileSpec("model.safetensors", len(WEIGHTS), "f" * 64)])

    def chunk(data: bytes, declared: int, sha: str) -> None:
        with store.chunk(OWNER, "m", "config.json", 0, declared) as writer:
            writer.write(data)
            writer.commit(sha)

    _refused(400, "longer than its declared", chunk, CONFIG, len(CONFIG) - 1, "")
    _refused(400, "does not match its X-Chunk-Sha256", chunk, CONFIG, len(CONFIG), "0" * 64)
    _refused(400, "has 0 of", store.finish, OWNER, "m", facts)
    send_all(store)
    _refused(400, "does not match its sha256", store.finish, OWNER, "m", facts)
    store.begin(OWNER, "m", [spec(n, d) for n, d in FILES.items()])
    send_all(store)

    def refuse(_model_dir: Path) -> dict:
        raise ValueError("no")

    _refused(400, "upload 'm' refused: no", store.finish, OWNER, "m", refuse)


def test_a_chunk_left_without_commit_keeps_nothing_and_the_largest_chunk_fits(tmp_path):
    store = UploadStore(tmp_path, 10**8)
    big = bytes(MAX_CHUNK_BYTES + 1)
    store.begin(OWNER, "m", [spec("config.json", CONFIG), spec("model.safetensors", big)])
    with store.chunk(OWNER, "m", "model.safetensors", 0, 10) as writer:
        writer.write(big[:10])  # the client went away: no commit
    assert store.received(OWNER, "m") == {"config.json": 0, "model.safetensors": 0}
    assert (tmp_path / OWNER / ".staging" / "m" / "model" / "model.safetensors").stat().st_size == 0
    send(store, "model.safetensors", big[:MAX_CHUNK_BYTES], 0)  # exactly the chunk limit
    assert store.received(OWNER, "m") == {"config.json": 0, "model.safetensors": MAX_CHUNK_BYTES}


def test_partial_uploads_reserve_the_disk_they_declared(tmp_path, monkeypatch):
    """Free space is checked against what the other partial uploads still have to send: two uploads that
    each fit the free disk alone cannot both be declared (both passed, then filled the disk), and the
    space comes back as the first one's bytes arrive or it is deleted."""
    import shutil as shutil_module

    store = UploadStore(tmp_path, 10**6)
    size = sum(len(d) for d in FILES.values())
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: real(path)._replace(free=size + size // 2))
    assert begin(store) == {"config.json": 0, "model.safetensors": 0}
    with pytest.raises(UploadError) as refused:
        store.begin(OTHER, "m", [spec(n, d) for n, d in FILES.items()])
    assert refused.value.status == 507 and "promised to partial uploads" in str(refused.value)
    assert begin(store) == {"config.json": 0, "model.safetensors": 0}  # resuming itself is not counted twice
    store.delete(OWNER, "m")
    assert store.begin(OTHER, "m", [spec(n, d) for n, d in FILES.items()]) == {"config.json": 0, "model.safetensors": 0}


def test_one_owner_cannot_promise_the_disk_away(tmp_path, monkeypatch):
    """Partial uploads declared and never sent held their bytes against every other owner's: one key with a
    few large declarations and no chunks took the whole disk for a week. An owner's partial uploads now
    promise at most --max-upload-gb together, and a promise no chunk reached for an hour lapses."""
    import os
    import shutil as shutil_module

    from tx import upload_store

    size = sum(len(d) for d in FILES.values())
    store = UploadStore(tmp_path, size + size // 2)
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: real(path)._replace(free=2 * size + size // 2))
    assert begin(store) == {"config.json": 0, "model.safetensors": 0}
    with pytest.raises(UploadError) as refused:
        store.begin(OWNER, "second", [spec(n, d) for n, d in FILES.items()])
    assert refused.value.status == 413 and "--max-upload-gb" in str(refused.value), refused.value
    assert store.begin(OTHER, "m", [spec(n, d) for n, d in FILES.items()])  # another owner's room is its own
    with pytest.raises(UploadError):  # the disk holds no third: both promises are alive
        store.begin("c" * 24, "m", [spec(n, d) for n, d in FILES.items()])
    idle = time.time() - upload_store.PROMISE_IDLE_S - 1
    for state in tmp_path.glob("*/.staging/*/state.json"):
        os.utime(state, (idle, idle))
    assert store.begin("c" * 24, "m", [spec(n, d) for n, d in FILES.items()])  # lapsed promises hold nothing


def test_config_and_tokenizer_files_are_bounded():
    weights = spec("model.safetensors", WEIGHTS)
    huge = FileSpec("tokenizer.json", (64 << 20) + 1, "0" * 64)
    with pytest.raises(UploadError) as refused:
        check_files([spec("config.json", CONFIG), weights, huge], 10**12)
    assert refused.value.status == 413 and "'tokenizer.json'" in str(refused.value) and "64 MiB" in str(refused.value)
    assert check_files([spec("config.json", CONFIG), weights, FileSpec("tokenizer.json", 64 << 20, "0" * 64)], 10**12)


def test_a_begin_waits_for_another_processs_disk_check(tmp_path):
    """The check of the disk and of a key's promised bytes, and the declaration it allows, were held under a
    thread lock: two API processes each saw room, and both of two uploads past the key's limit were
    accepted (30 trials in 60). They queue on a file lock in the data directory now."""
    import threading

    store = UploadStore(tmp_path / "uploads", 1 << 30)
    (tmp_path / "uploads").mkdir(exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.0)",
         str(tmp_path / "uploads" / ".disk.lock")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        done = threading.Event()
        threading.Thread(target=lambda: (begin(store), done.set()), daemon=True).start()
        assert not done.wait(0.4)  # the other process is checking: this begin waits its turn
        assert done.wait(30)
    finally:
        holder.wait(30)

"""Uploaded base models on disk: the one owner of `<data-dir>/uploads`.

Layout, per owner (the hash of an API key) and upload name:

    uploads/<owner>/.staging/<name>/state.json     the declared files and how many bytes of each are verified
    uploads/<owner>/.staging/<name>/model/<file>   the files as they arrive
    uploads/<owner>/<name>/upload.json             what the upload is (architecture, sizes, its id)
    uploads/<owner>/<name>/model-<id>/<file>       a complete, validated Hugging Face directory
    uploads/<owner>/.locks/<name>                  the upload's lock file (`flock`), shared by every process

An upload is written into `.staging`, one checked chunk at a time at the offset the store says it holds
(the bytes past the last verified chunk are cut off first, so a dropped connection or a killed server
resumes at a chunk boundary), and becomes visible only by one rename of the whole staging directory
after every file's sha256 and the caller's validation passed. So a partial upload is never listed or
found, and a present `<name>/upload.json` means a whole upload. A partial upload no chunk reached for a
week (`STALE_AFTER_S`) is removed when a server starts; what it declared and did not send holds disk against
other uploads while chunks keep coming (`PROMISE_IDLE_S`), up to `--max-upload-gb` per owner. Deletion
renames the directory into `.trash` before removing it. Every operation on one upload holds its lock file
(`flock`), so API processes sharing the data directory never interleave two requests' chunk writes,
publication or deletion; a second
request meanwhile is refused (423) and the client retries. Names never start with '.', so no upload can be
called `.staging` or `.locks`. The
model directory carries the upload's id, so an upload deleted and sent again under the same name is
another directory: model serving keys loaded models by directory and never mistakes new weights for old.

Every user string that becomes a path (owner, upload name, file name) is checked twice: by `check_name`
where it enters, and by `contained` where the path is built. Leaf module: imports only `tx.names` and
`tx.upload_files` (chunks, state, hashes, locks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tx.names import check_name, contained, is_valid_name
from tx.upload_files import ChunkWriter, UploadError, file_lock, flocked, read_state, sha256_of, write_state

UPLOAD_PREFIX = "upload:"
MAX_FILES = 1024
MAX_CHUNK_BYTES = 8 << 20  # one chunk request's body; below the API's smallest body limit
MAX_OTHER_FILE_BYTES = 64 << 20  # a config, tokenizer or index file (the largest hub tokenizers are ~35 MB)
GB = 1e9
_SHA256 = re.compile(r"[0-9a-f]{64}")
STALE_AFTER_S = 7 * 86400.0  # a partial upload untouched this long is removed when a server starts
PROMISE_IDLE_S = 3600.0  # a partial upload no chunk reached this long no longer holds disk for its bytes


@dataclass(frozen=True)
class FileSpec:
    """One file of an upload as the client declares it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class UploadInfo:
    """A complete upload, as `upload.json` records it."""

    name: str
    size_bytes: int
    files: int
    architecture: str
    max_context_length: int
    created_at: float
    upload_id: str

    @property
    def base_model(self) -> str:
        return UPLOAD_PREFIX + self.name


def upload_name(model: str) -> str | None:
    """The NAME of an `upload:NAME` model string, or None for any other string."""
    return model[len(UPLOAD_PREFIX) :] if model.startswith(UPLOAD_PREFIX) else None


def check_files(files: list[FileSpec], max_bytes: int) -> int:
    """The declared total size, after checking the file list; `UploadError` naming the problem."""
    if not 1 <= len(files) <= MAX_FILES:
        raise UploadError(400, f"an upload has 1-{MAX_FILES} files, got {len(files)}")
    names = [check_name(f.name, "file name") for f in files]
    if len(set(names)) != len(names):
        raise UploadError(400, "file names must be unique")
    for f in files:
        if not isinstance(f.size, int) or f.size < 0 or not _SHA256.fullmatch(str(f.sha256)):
            raise UploadError(400, f"file {f.name!r}: size must be an integer >= 0 and sha256 64 lowercase hex digits")
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise UploadError(400, "an upload needs config.json and .safetensors weights (a Hugging Face directory)")
    for f in files:  # config and tokenizer files are parsed whole in memory when the upload is validated
        if not f.name.endswith(".safetensors") and f.size > MAX_OTHER_FILE_BYTES:
            limit = f"{MAX_OTHER_FILE_BYTES >> 20} MiB"
            raise UploadError(413, f"file {f.name!r} has {f.size} bytes; files other than .safetensors are <= {limit}")
    total = sum(f.size for f in files)
    if total > max_bytes:
        limit = f"--max-upload-gb {max_bytes / GB:g}"
        raise UploadError(413, f"upload of {total / GB:.3f} GB ({total} bytes) is over this server's {limit}")
    return total


class UploadStore:
    """Staging, chunk writes, validation hand-off, listing, lookup and deletion of uploads."""

    def __init__(self, root: Path, max_upload_bytes: int, stale_after_s: float = STALE_AFTER_S) -> None:
        self.root = Path(root).resolve()
        self.max_upload_bytes = max_upload_bytes
        self._busy: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()
        for trash in self.root.glob("*/.trash"):
            shutil.rmtree(trash, ignore_errors=True)  # deletions a previous process did not finish
        for state in self.root.glob("*/.staging/*/state.json"):
            if time.time() - state.stat().st_mtime > stale_after_s:  # abandoned: no chunk for a week
                shutil.rmtree(state.parent, ignore_errors=True)

    # ---- paths: every component checked where it enters and again once the path is built ---------

    def _owner_dir(self, owner: str) -> Path:
        return contained(self.root / check_name(owner, "owner"), self.root)

    def _final(self, owner: str, name: str) -> Path:
        owner_dir = self._owner_dir(owner)
        return contained(owner_dir / check_name(name, "upload name"), owner_dir)

    def _staging(self, owner: str, name: str) -> Path:
        staging = self._owner_dir(owner) / ".staging"
        return contained(staging / check_name(name, "upload name"), staging)

    def _file(self, owner: str, name: str, file: str) -> Path:
        model = self._staging(owner, name) / "model"
        return contained(model / check_name(file, "file name"), model)

    def _lock_file(self, owner: str, name: str) -> Path:
        locks = self._owner_dir(owner) / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return contained(locks / check_name(name, "upload name"), locks)

    @contextmanager
    def _exclusive(self, owner: str, name: str) -> Iterator[None]:
        """One operation at a time per upload, across every process on this data directory (`--role api`
        processes share it); a second one meanwhile is refused with 423 (the client retries)."""
        key = (owner, name)
        with self._lock:
            if key in self._busy:
                raise UploadError(423, f"upload {name!r} is busy with another request; retry")
            self._busy.add(key)
        try:
            with flocked(self._lock_file(owner, name), name):
                yield
        finally:
            with self._lock:
                self._busy.discard(key)

    # ---- staging ---------------------------------------------------------------------------------

    def begin(self, owner: str, name: str, files: list[FileSpec]) -> dict[str, int]:
        """Start or resume upload `name`: bytes already verified per file (0 for new or changed files)."""
        total = check_files(files, self.max_upload_bytes)
        with self._exclusive(owner, name):
            if (self._final(owner, name) / "upload.json").is_file():
                raise UploadError(409, f"upload {name!r} already exists; delete it first (--delete {name})")
            staging = self._staging(owner, name)
            old = read_state(staging)
            kept = {f.name: old["received"].get(f.name, 0) for f in files if asdict(f) in old["files"]}
            state: dict[str, Any] = {
                "files": [asdict(f) for f in files],
                "received": {f.name: kept.get(f.name, 0) for f in files},
            }
            with self._disk_lock, file_lock(self.root / ".disk.lock"):  # the check and this upload's declaration
                # together, each begin seeing the others': on every API process (a thread lock held only its own)
                self._need_disk(total - sum(kept.values()), staging, owner)
                (staging / "model").mkdir(parents=True, exist_ok=True)
                write_state(staging, state)
            for stale in (staging / "model").iterdir():
                if stale.name not in kept:
                    stale.unlink()
            for empty in (f for f in files if f.size == 0):
                self._file(owner, name, empty.name).touch()
            return dict(state["received"])

    def _need_disk(self, more: int, staging: Path, owner: str) -> None:
        """Room for `more` bytes beside what the other partial uploads have declared and not sent yet: each
        begin checked the free space alone, so fifty declared at once all passed and then filled the disk.
        One owner's partial uploads promise at most `max_upload_bytes` together, and a promise no chunk kept
        alive for `PROMISE_IDLE_S` lapses: declared and never sent, they held every other owner off the disk."""
        self.root.mkdir(parents=True, exist_ok=True)
        by_owner = self._promised(skip=staging)
        mine = by_owner.get(check_name(owner, "owner"), 0)
        if mine + more > self.max_upload_bytes:
            raise UploadError(
                413,
                f"your partial uploads already promise {mine / GB:.3f} GB and this one {more / GB:.3f} more, over "
                f"--max-upload-gb {self.max_upload_bytes / GB:g} together; finish or delete one first",
            )
        free, promised = shutil.disk_usage(self.root).free, sum(by_owner.values())
        if more > free - promised:
            raise UploadError(
                507,
                f"the server has {free / GB:.3f} GB of disk free, {promised / GB:.3f} GB of it promised to partial "
                f"uploads not finished yet; this upload needs {more / GB:.3f}",
            )

    def _promised(self, skip: Path) -> dict[str, int]:
        """Bytes each owner's partial uploads but `skip` have declared and not sent yet, where a chunk came
        within `PROMISE_IDLE_S` (each chunk rewrites the state file)."""
        by_owner: dict[str, int] = {}
        for state_file in self.root.glob("*/.staging/*/state.json"):
            if state_file.parent == skip:
                continue
            try:
                if time.time() - state_file.stat().st_mtime > PROMISE_IDLE_S:
                    continue
                state = read_state(state_file.parent)
                owed = sum(max(f["size"] - state["received"].get(f["name"], 0), 0) for f in state["files"])
            except (OSError, ValueError, KeyError, TypeError):  # gone meanwhile, or not ours to read
                continue
            owner = state_file.parent.parent.parent.name
            by_owner[owner] = by_owner.get(owner, 0) + owed
        return by_owner

    def received(self, owner: str, name: str) -> dict[str, int] | None:
        """Verified bytes per file of a partial upload; None when there is none."""
        state = read_state(self._staging(owner, name))
        return dict(state["received"]) if state["files"] else None

    @contextmanager
    def chunk(self, owner: str, name: str, file: str, offset: int, length: int) -> Iterator[ChunkWriter]:
        """A writer for `length` bytes of `file` at `offset`, which must be the bytes verified so far. Nothing
        it wrote survives unless `commit` accepted its sha256."""
        with self._exclusive(owner, name):
            staging = self._staging(owner, name)
            state = read_state(staging)
            spec = next((f for f in state["files"] if f["name"] == file), None)
            if spec is None:
                raise UploadError(404, f"upload {name!r} has no file {file!r} in progress")
            held = state["received"][file]
            if offset != held:
                raise UploadError(416, f"file {file!r}: the server holds {held} bytes, the chunk starts at {offset}")
            if not 1 <= length <= MAX_CHUNK_BYTES or offset + length > spec["size"]:
                raise UploadError(
                    400, f"chunk of {length} bytes at {offset}: 1-{MAX_CHUNK_BYTES} bytes within {spec['size']}"
                )
            writer = ChunkWriter(self._file(owner, name, file), offset, length)
            try:
                yield writer
            finally:
                writer.close()
            if writer.accepted:
                state["received"][file] = offset + length
                write_state(staging, state)

    # ---- completion ------------------------------------------------------------------------------

    def finish(self, owner: str, name: str, check: Callable[[Path], dict[str, Any]]) -> UploadInfo:
        """Verify every file whole, run `check` (the model's validation: a dict with `architecture` and
        `max_context_length`, or `ValueError`) and publish the upload. A refused upload is removed."""
        with self._exclusive(owner, name):
            staging = self._staging(owner, name)
            state = read_state(staging)
            if not state["files"]:
                raise UploadError(404, f"no upload {name!r} in progress")
            self._verify_files(owner, name, state)
            try:
                facts = check(staging / "model")
            except ValueError as err:
                shutil.rmtree(staging, ignore_errors=True)
                raise UploadError(400, f"upload {name!r} refused: {err}") from None
            sizes, upload_id = [f["size"] for f in state["files"]], uuid.uuid4().hex[:12]
            info = UploadInfo(name, sum(sizes), len(sizes), created_at=time.time(), upload_id=upload_id, **facts)
            os.replace(staging / "model", staging / f"model-{upload_id}")
            (staging / "upload.json").write_text(json.dumps(asdict(info), indent=2))
            (staging / "state.json").unlink()
            os.replace(staging, self._final(owner, name))
            return info

    def _verify_files(self, owner: str, name: str, state: dict[str, Any]) -> None:
        for spec in state["files"]:
            held = state["received"][spec["name"]]
            if held != spec["size"]:
                raise UploadError(400, f"file {spec['name']!r} has {held} of {spec['size']} bytes: resume the upload")
            path = self._file(owner, name, spec["name"])
            if sha256_of(path) != spec["sha256"]:
                state["received"][spec["name"]] = 0
                path.unlink(missing_ok=True)
                write_state(self._staging(owner, name), state)
                raise UploadError(400, f"file {spec['name']!r} does not match its sha256; it must be sent again")

    # ---- complete uploads --------------------------------------------------------------------------

    def get(self, owner: str, name: str) -> UploadInfo | None:
        manifest = self._final(owner, name) / "upload.json"
        return UploadInfo(**json.loads(manifest.read_text())) if manifest.is_file() else None

    def uploads(self, owner: str) -> list[UploadInfo]:
        owner_dir = self._owner_dir(owner)
        names = sorted(p.parent.name for p in owner_dir.glob("*/upload.json") if is_valid_name(p.parent.name))
        return [info for info in (self.get(owner, n) for n in names) if info is not None]

    def delete(self, owner: str, name: str) -> bool:
        """Remove upload `name` (complete or partial); False when there is neither."""
        with self._exclusive(owner, name):
            found = False
            for directory in (self._final(owner, name), self._staging(owner, name)):
                if directory.is_dir():
                    trash = self._owner_dir(owner) / ".trash" / f"{name}-{uuid.uuid4().hex}"
                    trash.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(directory, trash)  # gone at once; the files are removed after
                    shutil.rmtree(trash, ignore_errors=True)
                    found = True
            return found

    # ---- the hooks model serving resolves `upload:NAME` strings with -------------------------------

    def find_upload(self, owner: str, model: str) -> Path | None:
        """The model directory of `owner`'s complete upload named by `model` (`upload:NAME`); None for
        another owner's upload, a partial one, a malformed name or a string that names no upload."""
        name = upload_name(model)
        if name is None or not is_valid_name(name) or not is_valid_name(owner):
            return None
        info = self.get(owner, name)
        return self._final(owner, name) / f"model-{info.upload_id}" if info is not None else None

    def list_uploads(self, owner: str) -> list[str]:
        """The model strings (`upload:NAME`) of `owner`'s complete uploads."""
        return [info.base_model for info in self.uploads(owner)] if is_valid_name(owner) else []

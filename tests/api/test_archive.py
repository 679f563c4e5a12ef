"""Checkpoint archives are streamed: a tar of any size in pieces of at most a megabyte, exactly as announced."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from api.harness import MODEL
from tx.api.context import AppContext, Settings
from tx.api.limits import limits_for
from tx.api.routes_rest import TAR_CHUNK, _tar_members, _tar_stream
from tx.upload_store import UploadStore

SIZES = {"empty": 0, "a.json": 511, "b.bin": 512, "c.bin": 513, "nested/big.safetensors": 3 * TAR_CHUNK + 7}


def _checkpoint(root: Path) -> Path:
    for index, (name, size) in enumerate(SIZES.items()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((index + i) % 251 for i in range(size)))
    (root / "link").symlink_to(root / "a.json")  # never followed into the archive
    return root


def _announced(members: list) -> int:  # type: ignore[type-arg]
    return sum(len(header) + -(-info.size // 512) * 512 for _, info, header in members) + 1024


def test_the_stream_is_a_tar_of_every_file_in_bounded_pieces(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ckpt")
    members = _tar_members(directory)
    pieces = list(_tar_stream(members))
    assert max(len(piece) for piece in pieces) <= TAR_CHUNK
    data = b"".join(pieces)
    assert len(data) == _announced(members) and len(data) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = {m.name: m for m in tar.getmembers()}
        assert set(names) == {*SIZES, "nested"} and names["nested"].isdir()
        for name, size in SIZES.items():
            extracted = tar.extractfile(name)
            assert extracted is not None and extracted.read() == (directory / name).read_bytes(), name
            assert names[name].size == size


def test_a_file_that_shrinks_mid_download_keeps_the_announced_length(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ckpt")
    members = _tar_members(directory)
    (directory / "nested/big.safetensors").write_bytes(b"x" * 10)  # overwritten after the headers were made
    data = b"".join(_tar_stream(members))
    assert len(data) == _announced(members)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        extracted = tar.extractfile("nested/big.safetensors")
        assert extracted is not None and extracted.read() == b"x" * 10 + bytes(SIZES["nested/big.safetensors"] - 10)
        a_json = tar.extractfile("a.json")
        assert a_json is not None and a_json.read() == (directory / "a.json").read_bytes()


def test_a_checkpoint_replaced_or_deleted_mid_download_streams_whole_as_it_was(tmp_path: Path) -> None:
    """A save over the checkpoint (the directory swapped for a new one) or its deletion while the archive
    streams: files were opened by path as the stream reached them, so they came from the new directory (cut
    or padded to the old sizes, with no error) or were gone. The archive is the checkpoint as it was listed."""
    import shutil

    directory = _checkpoint(tmp_path / "ckpt")
    want = {name: (directory / name).read_bytes() for name in SIZES}
    for change in ("replaced", "deleted"):
        members = _tar_members(directory)
        shutil.rmtree(directory)
        if change == "replaced":
            (directory / "nested").mkdir(parents=True)
            (directory / "nested/big.safetensors").write_bytes(b"new" * 5)
        data = b"".join(_tar_stream(members))
        assert len(data) == _announced(members)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for name, content in want.items():
                extracted = tar.extractfile(name)
                assert extracted is not None and extracted.read() == content, (change, name)
        shutil.rmtree(directory, ignore_errors=True)
        directory = _checkpoint(tmp_path / "ckpt")


def test_a_file_that_cannot_be_opened_fails_the_archive_instead_of_leaving_it_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every error opening a member read as "gone": out of file handles, the client got a 200 and a well-formed
    archive missing files. Only a file gone or swapped for a link is left out; anything else raises."""
    import errno
    import os

    directory = _checkpoint(tmp_path / "ckpt")
    real_open = os.open

    def no_handles(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(".bin"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_handles)
    with pytest.raises(OSError) as raised:
        _tar_members(directory)
    assert raised.value.errno == errno.EMFILE


def test_one_download_link_per_checkpoint_however_often_asked(tmp_path: Path) -> None:
    uploads = UploadStore(tmp_path / "u", 0)
    ctx = AppContext(Settings(data_dir=tmp_path, archive_url_ttl_s=3600), None, MODEL, limits_for(MODEL), uploads)  # type: ignore[arg-type]
    first = ctx.issue_download(tmp_path / "a")
    assert all(ctx.issue_download(tmp_path / "a") == first for _ in range(100))
    assert ctx.issue_download(tmp_path / "b") != first and ctx.links.resolve(first) == (tmp_path / "a").resolve()


def test_a_link_works_on_every_api_process_and_after_a_restart_and_not_once_changed(tmp_path: Path) -> None:
    """Links lived in one process's memory: behind a load balancer half of them reached an API server that
    did not know them, and a restart lost them all. A link is signed with a key in the data directory; one
    changed, made up or expired is refused."""
    import time

    from tx.api.download_links import DownloadLinks

    one, other = DownloadLinks(tmp_path, 3600), DownloadLinks(tmp_path, 3600)  # two processes, one data dir
    (tmp_path / "checkpoints" / "r").mkdir(parents=True)
    token, expires = one.issue(tmp_path / "checkpoints" / "r")
    assert 1800 <= expires - time.time() <= 3600
    assert other.resolve(token) == one.resolve(token) == (tmp_path / "checkpoints" / "r").resolve()
    name, until, signature = token.split(".")
    forged = DownloadLinks(tmp_path / "elsewhere", 3600).issue(tmp_path / "elsewhere" / "r")[0]
    malformed = ("a.\u00b2.b", f"{name}.{until}.{signature[:-1]}\u00e9", "x", "a.b.c", "")  # a 500 each before
    for bad in (f"{name}.{int(until) + 1}.{signature}", f"Li4.{until}.{signature}", forged, *malformed):
        assert other.resolve(bad) is None, bad
    past = int(time.time()) - 1
    assert other.resolve(f"{name}.{past}.{one._sign(name, past)}") is None  # signed, but expired
    with pytest.raises(ValueError):  # only what lies in the data directory gets a link
        one.issue(tmp_path.parent)

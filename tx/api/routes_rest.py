"""REST endpoints over runs and checkpoints: listing, info, delete, publish, TTL, archive and file downloads.

All lookups are scoped to the caller's key: another key's run or checkpoint answers 404. Checkpoint
ids in paths contain a slash (`weights/step-10`), hence the `{kind}/{name}` route segments. The
archive endpoint (SDK <= 0.33 download) redirects to a one-off, unauthenticated tar download URL;
`external_weights_urls` (SDK 0.38 download) hands out one unauthenticated URL per exported file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse

from tx.api.context import AppContext, Ctx, Owner, not_found, user_error
from tx.api.paths import KIND_TO_TYPE, checkpoints_root
from tx.api.schemas import PageLimit, PageOffset, TtlRequest
from tx.api.validate import check_ttl
from tx.db.records import Records
from tx.db.tables import CheckpointRow, TrainingRunRow, utcnow
from tx.names import BadName, check_name, contained

log = logging.getLogger("tx.api")

router = APIRouter(prefix="/api/v1")


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return aware.isoformat().replace("+00:00", "Z")


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": row.checkpoint_id,
        "checkpoint_type": row.checkpoint_type,
        "time": _iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "expires_at": _iso(row.expires_at),
        "user_metadata": json.loads(row.user_metadata_json) or None,
    }


def runs_json(ctx: AppContext, runs: list[TrainingRunRow], owner: str) -> list[dict[str, Any]]:
    newest = ctx.db.records.latest_checkpoints(owner, [run.id for run in runs])
    return [run_json(run, owner, newest) for run in runs]


def run_json(run: TrainingRunRow, owner: str, newest: dict[tuple[str, str], CheckpointRow]) -> dict[str, Any]:
    latest = {kind: newest.get((run.id, kind)) for kind in ("training", "sampler")}
    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": owner,
        "is_lora": run.lora_rank is not None,
        "corrupted": False,
        "lora_rank": run.lora_rank,
        "last_request_time": _iso(run.last_request_at),
        "last_checkpoint": checkpoint_json(latest["training"]) if latest["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(latest["sampler"]) if latest["sampler"] else None,
        "user_metadata": json.loads(run.user_metadata_json) or None,
    }


@router.get("/training_runs")
def list_training_runs(ctx: Ctx, owner: Owner, limit: PageLimit = 20, offset: PageOffset = 0) -> dict[str, Any]:
    runs, total = ctx.db.records.list_runs(owner, limit, offset)
    cursor = {"offset": offset, "limit": limit, "total_count": total}
    return {"training_runs": runs_json(ctx, runs, owner), "cursor": cursor}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    run = ctx.db.records.get_run(run_id, owner)
    if run is None or run.status in ("pending", "failed"):
        not_found(f"unknown training run {run_id!r}")
    return runs_json(ctx, [run], owner)[0]


# The SDK's version, which it sends with every request.
SdkVersion = Annotated[str | None, Header(alias="x-stainless-package-version")]


def known_types(sdk_version: str | None) -> tuple[str, ...] | None:
    """The checkpoint types a client's SDK can read (None: any). Before 0.28 its listing's schema knew only
    "training" and "sampler": one "external" entry (`save_weights_external`, by a newer SDK with the same
    key) failed the whole listing's validation, so none of the key's checkpoints could be listed."""
    try:
        major, minor = (int(part) for part in (sdk_version or "").split(".")[:2])
    except ValueError:
        return None
    return ("training", "sampler") if (major, minor) < (0, 28) else None


@router.get("/training_runs/{run_id}/checkpoints")
@router.get("/models/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, ctx: Ctx, owner: Owner, sdk: SdkVersion = None) -> dict[str, Any]:
    if ctx.db.records.get_run(run_id, owner) is None:
        not_found(f"unknown training run {run_id!r}")
    rows, total = ctx.db.records.list_checkpoints(owner, run_id, 10_000, 0, known_types(sdk))
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": {"offset": 0, "limit": len(rows), "total_count": total},
    }


@router.get("/checkpoints")
def list_user_checkpoints(
    ctx: Ctx, owner: Owner, limit: PageLimit = 100, offset: PageOffset = 0, sdk: SdkVersion = None
) -> dict[str, Any]:
    rows, total = ctx.db.records.list_checkpoints(owner, None, limit, offset, known_types(sdk))
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


def _owned_checkpoint(
    ctx: AppContext, run_id: str, kind: str, name: str, owner: str, or_replaced: bool = False
) -> CheckpointRow:
    if kind not in KIND_TO_TYPE:
        kinds = ", ".join(f"'{k}/'" for k in KIND_TO_TYPE)
        user_error(f"checkpoint id must start with one of {kinds}, got {kind + '/' + name!r}")
    check_name(name, "checkpoint name")
    row = ctx.db.records.get_checkpoint(run_id, f"{kind}/{name}", owner, or_replaced=or_replaced)
    if row is None:
        not_found(f"unknown checkpoint {kind}/{name} of training run {run_id!r}")
    return row


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204)
def delete_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, owner: Owner) -> Response:
    remove_checkpoint(ctx.db.records, ctx.settings.data_dir, _owned_checkpoint(ctx, run_id, kind, name, owner))
    return Response(status_code=204)


def remove_checkpoint(records: Records, data_dir: Path, row: CheckpointRow) -> None:
    """The row, then its files: a reader never finds a row whose files are half gone. Only a row still as
    it was read goes: one a save over its name set aside since shares its directory with that save, whose
    files those now are. The directory is renamed before it is removed, so a save that takes the name
    right after the row went writes a directory of its own (`sweep_partial` clears what a crash leaves)."""
    directory = contained(row.directory, checkpoints_root(data_dir))
    if not records.delete_checkpoint(row, as_read=True):
        return
    doomed = directory.with_name(f".{directory.name}.removed-{row.id}")
    try:
        os.rename(directory, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def sweep_expired_checkpoints(records: Records, data_dir: Path) -> int:
    """Remove every checkpoint past its ttl, rows and files; one whose recorded directory lies outside the
    checkpoint root loses its row and keeps the files (never delete what this server did not write)."""
    rows = records.expired_checkpoints()
    for row in rows:
        log.info("checkpoint %s expired: removing it", row.tinker_path)
        try:
            remove_checkpoint(records, data_dir, row)
        except BadName:
            log.error("checkpoint %s: directory %r is outside the checkpoint root", row.tinker_path, row.directory)
            records.delete_checkpoint(row)
    return len(rows)


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
def publish_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, owner: Owner) -> Response:
    ctx.db.records.update_checkpoint(_owned_checkpoint(ctx, run_id, kind, name, owner), public=True)
    return Response(status_code=204)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
def unpublish_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, owner: Owner) -> Response:
    ctx.db.records.update_checkpoint(_owned_checkpoint(ctx, run_id, kind, name, owner), public=False)
    return Response(status_code=204)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", status_code=204)
def set_checkpoint_ttl(run_id: str, kind: str, name: str, body: TtlRequest, ctx: Ctx, owner: Owner) -> Response:
    check_ttl(body.ttl_seconds)
    row = _owned_checkpoint(ctx, run_id, kind, name, owner)
    expires = utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    ctx.db.records.update_checkpoint(row, expires_at=expires)
    return Response(status_code=204)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
def checkpoint_archive(run_id: str, kind: str, name: str, request: Request, ctx: Ctx, owner: Owner) -> Response:
    row = _owned_checkpoint(ctx, run_id, kind, name, owner, or_replaced=True)
    token, until = ctx.links.issue(Path(row.directory))
    url = str(request.url_for("download_archive", token=token))
    expires = datetime.fromtimestamp(until, UTC)
    return RedirectResponse(url, status_code=302, headers={"Expires": expires.strftime("%a, %d %b %Y %H:%M:%S GMT")})


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
def external_weights_urls(
    run_id: str, kind: str, name: str, request: Request, ctx: Ctx, owner: Owner
) -> dict[str, Any]:
    """One unauthenticated download URL per file of an external-weights export (`tinker checkpoint download`)."""
    row = _owned_checkpoint(ctx, run_id, kind, name, owner, or_replaced=True)
    if row.checkpoint_type != "external":
        user_error(f"{row.tinker_path!r} is not an external weights checkpoint (…/external_weights/<name>)")
    directory = Path(row.directory)
    if not directory.is_dir():
        not_found(f"the files of {row.tinker_path!r} are gone")
    token, until = ctx.links.issue(directory)
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    urls = {rel: str(request.url_for("download_file", token=token, file_path=rel)) for rel in files}
    return {"urls": urls, "expires": _iso(datetime.fromtimestamp(until, UTC))}


@router.get("/file_downloads/{token}/{file_path:path}", name="download_file")
def download_file(token: str, file_path: str, ctx: Ctx) -> Response:
    linked = ctx.links.resolve(token)
    if linked is None:
        not_found("unknown or expired download link")
    root = linked
    parts = file_path.split("/")
    if "\x00" in file_path or any(part in ("", ".", "..") for part in parts):  # as written, before resolving
        not_found(f"no file {file_path[:200]!r} in this checkpoint")
    target = root.joinpath(*parts).resolve()  # and again once resolved: a link may lead out
    if not target.is_relative_to(root) or not target.is_file():
        not_found(f"no file {file_path[:200]!r} in this checkpoint")
    return FileResponse(target, media_type="application/octet-stream")


@router.get("/archive_downloads/{token}", name="download_archive")
async def download_archive(token: str, ctx: Ctx) -> Response:
    directory = ctx.links.resolve(token)
    if directory is None:
        not_found("unknown or expired download link")
    try:
        members = await run_in_threadpool(_tar_members, directory)
    except (FileNotFoundError, NotADirectoryError):
        not_found("the checkpoint files are gone")
    except OSError as err:  # out of file handles, say: a download missing files would be worse
        detail = f"the checkpoint's files cannot be opened now ({err.strerror}); retry"
        raise HTTPException(503, detail=detail) from None
    headers = {
        "Content-Disposition": f'attachment; filename="{directory.name}.tar"',
        "Content-Length": str(sum(len(header) + _padded(info.size) for _, info, header in members) + TAR_END),
    }
    return StreamingResponse(_tar_stream(members), media_type="application/x-tar", headers=headers)


TAR_BLOCK, TAR_END, TAR_CHUNK = 512, 1024, 1 << 20


def _padded(size: int) -> int:
    return -(-size // TAR_BLOCK) * TAR_BLOCK


def _tar_members(directory: Path) -> list[tuple[BinaryIO | None, tarfile.TarInfo, bytes]]:
    """(the open file, its tar entry, the entry's header) for the directory's regular files and folders, in
    name order; links and anything else are left out (the server wrote the checkpoint: it holds neither).
    Every file is opened now, from one handle on the directory: a save over the checkpoint or its deletion
    while a large archive streams swaps or removes the directory, and files opened later by path came from
    the new one or were gone (a truncated file inside an archive of the announced length, or an abort)."""
    members = []
    root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder, dirs, files, folder_fd in os.fwalk(".", dir_fd=root):
            for name in [*dirs, *files]:
                member = _member(Path(folder, name), name, folder_fd)
                if member is not None:
                    members.append(member)
    finally:
        os.close(root)
    return sorted(members, key=lambda member: member[1].name)


def _member(relative: Path, name: str, folder_fd: int) -> tuple[BinaryIO | None, tarfile.TarInfo, bytes] | None:
    try:
        stat = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        file = None
        if S_ISREG(stat.st_mode):
            file = os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd), "rb")
            stat = os.fstat(file.fileno())
    except OSError as err:  # gone meanwhile, or swapped for a link; anything else fails the download
        if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None
        raise
    if file is None and not S_ISDIR(stat.st_mode):
        return None
    info = tarfile.TarInfo(relative.as_posix().removeprefix("./"))
    info.mtime, info.mode = int(stat.st_mtime), stat.st_mode & 0o777
    info.type, info.size = (tarfile.REGTYPE, stat.st_size) if file else (tarfile.DIRTYPE, 0)
    return file, info, info.tobuf(tarfile.PAX_FORMAT)


def _tar_stream(members: list[tuple[BinaryIO | None, tarfile.TarInfo, bytes]]) -> Iterator[bytes]:
    """The archive a megabyte at a time: a checkpoint of any size downloads in constant memory. A file that
    shrank since its header was written is padded with zeros, so the archive keeps its announced length."""
    try:
        for file, info, header in members:
            yield header
            left = info.size
            while file is not None and left and (chunk := file.read(min(TAR_CHUNK, left))):
                left -= len(chunk)
                yield chunk
            for start in range(0, left + _padded(info.size) - info.size, TAR_CHUNK):  # padding, and any shortfall
                yield bytes(min(TAR_CHUNK, left + _padded(info.size) - info.size - start))
    finally:
        for file, _, _ in members:
            if file is not None:
                file.close()
    yield bytes(TAR_END)

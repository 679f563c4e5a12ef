"""Base-model uploads (`python -m tx.upload`): start or resume, send checked chunks, finish, list, delete.

    POST   /api/v1/uploads/{name}                  declare the files (name, size, sha256) and config.json;
                                                   answers the bytes already held per file (resume)
    GET    /api/v1/uploads/{name}                  a complete upload, or what a partial one holds
    PUT    /api/v1/uploads/{name}/files/{file}     one chunk: ?offset=, Content-Length, X-Chunk-Sha256
    POST   /api/v1/uploads/{name}/finish           verify, validate (`tx.api.upload_check`), publish
    GET    /api/v1/uploads                         the caller's complete uploads
    DELETE /api/v1/uploads/{name}                  remove a complete or partial upload

Everything is scoped to the caller's key: another key's upload is a 404 like one that does not exist.
A chunk is streamed to disk as it arrives (memory per request: one network read), at most
`MAX_CHUNK_BYTES`, and kept only when its sha256 matches. Names are checked here (`check_name`, a 400
naming the rule) and again by the store where they become paths.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from tx.api.context import Ctx, Owner, not_found
from tx.api.upload_check import check_config, check_upload
from tx.names import check_name
from tx.upload_store import MAX_CHUNK_BYTES, MAX_FILES, UPLOAD_PREFIX, FileSpec, UploadError, UploadInfo

router = APIRouter(prefix="/api/v1")


class UploadFile(BaseModel):
    name: str = Field(max_length=256)
    size: int = Field(ge=0, lt=2**63)
    sha256: str = Field(max_length=64)


class BeginUpload(BaseModel):
    files: list[UploadFile] = Field(max_length=MAX_FILES)
    config: dict[str, Any] | None = None  # config.json, checked before any weight is sent


def _refused(err: UploadError) -> HTTPException:
    return HTTPException(err.status, detail=str(err))


def _described(info: UploadInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "base_model": info.base_model,
        "state": "ready",
        "architecture": info.architecture,
        "max_context_length": info.max_context_length,
        "size_bytes": info.size_bytes,
        "files": info.files,
        "created_at": info.created_at,
    }


@router.post("/uploads/{name}")
def begin_upload(name: str, body: BeginUpload, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    check_name(name, "upload name")
    if body.config is not None:
        try:
            check_config(body.config)
        except ValueError as err:
            raise HTTPException(400, detail=f"upload {name!r} refused: {err}") from None
    files = [FileSpec(f.name, f.size, f.sha256) for f in body.files]
    try:
        received = ctx.uploads.begin(owner, name, files)
    except UploadError as err:
        raise _refused(err) from None
    return {"name": name, "state": "partial", "received": received, "chunk_bytes": MAX_CHUNK_BYTES}


@router.get("/uploads/{name}")
def get_upload(name: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    check_name(name, "upload name")
    info = ctx.uploads.get(owner, name)
    if info is not None:
        return _described(info)
    received = ctx.uploads.received(owner, name)
    if received is None:
        not_found(f"no upload named {name!r}")
    return {"name": name, "state": "partial", "received": received, "chunk_bytes": MAX_CHUNK_BYTES}


@router.put("/uploads/{name}/files/{file}")
async def put_chunk(
    name: str,
    file: str,
    request: Request,
    ctx: Ctx,
    owner: Owner,
    offset: Annotated[int, Query(ge=0, lt=2**63)],
    content_length: Annotated[int, Header(ge=1, le=MAX_CHUNK_BYTES)],
    x_chunk_sha256: Annotated[str, Header(max_length=64)],
) -> dict[str, Any]:
    check_name(name, "upload name")
    check_name(file, "file name")
    try:
        with ctx.uploads.chunk(owner, name, file, offset, content_length) as writer:
            async for piece in request.stream():
                writer.write(piece)
            writer.commit(x_chunk_sha256.lower())
    except UploadError as err:
        raise _refused(err) from None
    except ClientDisconnect:
        raise HTTPException(400, detail="the connection closed mid-chunk; the chunk was dropped") from None
    return {"file": file, "received": offset + content_length}


@router.post("/uploads/{name}/finish")
async def finish_upload(name: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    check_name(name, "upload name")
    try:
        info = await run_in_threadpool(ctx.uploads.finish, owner, name, check_upload)
    except UploadError as err:
        raise _refused(err) from None
    return _described(info)


@router.get("/uploads")
def list_uploads(ctx: Ctx, owner: Owner) -> dict[str, Any]:
    return {"uploads": [_described(info) for info in ctx.uploads.uploads(owner)]}


@router.delete("/uploads/{name}")
def delete_upload(name: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    check_name(name, "upload name")
    try:
        found = ctx.uploads.delete(owner, name)
    except UploadError as err:
        raise _refused(err) from None
    if not found:
        not_found(f"no upload named {name!r}")
    ctx.models.forget_upload(owner, UPLOAD_PREFIX + name)  # a model loaded from it stays until it is idle
    return {"name": name, "deleted": True}

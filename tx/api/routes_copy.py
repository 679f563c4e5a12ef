"""`POST /copy_weights` (SDK 0.27+ `RestClient.copy_weights` / `ServiceClient.copy_weights`).

A copy is a new checkpoint with the source's kind and name, owned by a new training run that
cannot be trained on (status `unloaded`; it can be loaded from, sampled, exported, downloaded).
The destination run is `{session_id}:train:{model_seq_id}` when the caller names a session slot,
otherwise `copy-<id>:train:0` (SmolGym has no projects, so `destination_project_id` only selects
this form). The files are copied into a temporary directory next to the destination and renamed
into place, then the run and checkpoint records are inserted in one transaction.

Retries are safe: with an `X-Idempotency-Key` the destination run id is derived from the key, and
a request whose destination already holds the same checkpoint returns that copy again.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException
from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.exc import IntegrityError

from tx.api.context import AppContext, Ctx, Owner, not_found, user_error
from tx.api.paths import TinkerPath, checkpoint_dir
from tx.api.routes_weights import resolve_checkpoint
from tx.api.schemas import Int64
from tx.api.validate import check_ttl
from tx.db.tables import CheckpointRow, TrainingRunRow, utcnow

log = logging.getLogger("tx.api")

router = APIRouter(prefix="/api/v1")


class CopyWeightsRequest(BaseModel):
    """SDK 0.38 `CopyWeightsRequest` (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    source_path: str
    session_id: str | None = None
    model_seq_id: Int64 | None = None
    destination_project_id: str | None = None
    ttl_seconds: Int64 | None = None
    weights_access_token: str | None = None


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body, answering 400 with a detail that names each offending field."""
    if not isinstance(body, dict):
        user_error("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except PydanticValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        problems = [f"{'.'.join(str(part) for part in e['loc']) or 'body'}: {e['msg']}" for e in errors[:10]]
        more = f"; and {len(errors) - 10} more" if len(errors) > 10 else ""
        user_error("invalid request body: " + "; ".join(problems) + more)


@router.post("/copy_weights")
async def copy_weights(
    ctx: Ctx,
    owner: Owner,
    body: Annotated[Any, Body()] = None,
    x_idempotency_key: Annotated[str | None, Header()] = None,
    x_tinker_weights_access_token: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """Runs on the copy threads (`AppContext.copy_pool`): copies wait there for one another, never holding a
    thread that other routes need."""
    loop = asyncio.get_running_loop()
    run = functools.partial(_copy_weights, ctx, owner, body, x_idempotency_key, x_tinker_weights_access_token)
    return await loop.run_in_executor(ctx.copy_pool, run)


def _copy_weights(
    ctx: AppContext, owner: str, body: Any, x_idempotency_key: str | None, x_tinker_weights_access_token: str | None
) -> dict[str, Any]:
    request: CopyWeightsRequest = parse_body(CopyWeightsRequest, body)
    if request.weights_access_token or x_tinker_weights_access_token:
        user_error(
            "weights_access_token: SmolGym has no weights access tokens (one API key = one owner);"
            " copy a checkpoint of your own key and omit the token"
        )
    ttl = request.ttl_seconds
    check_ttl(ttl)
    source_path, source = resolve_checkpoint(ctx, request.source_path, owner)
    source_run = ctx.db.records.get_run(source_path.run_id, owner)
    if source_run is None:
        not_found(f"the training run of {request.source_path!r} no longer exists")
    session_id, run_id = _destination(ctx, request, owner, x_idempotency_key)
    dest = TinkerPath(run_id, source_path.kind, source_path.name)

    existing = ctx.db.records.get_run(run_id, owner)
    if existing is not None:
        return _existing_copy(ctx, existing, dest, owner)

    directory = checkpoint_dir(ctx.settings.data_dir, dest)

    def owned() -> bool:
        return ctx.db.records.get_run(run_id, owner) is not None

    _copy_tree(Path(source.directory), directory, request.source_path, owned)
    run = TrainingRunRow(
        id=run_id, session_id=session_id, owner=owner, base_model=source_run.base_model,
        lora_rank=source_run.lora_rank, lora_alpha=source_run.lora_alpha, train_attn=source_run.train_attn,
        train_mlp=source_run.train_mlp, train_unembed=source_run.train_unembed, status="unloaded",
        user_metadata_json=json.dumps({}),
    )  # fmt: skip
    checkpoint = CheckpointRow(
        run_id=run_id, checkpoint_id=dest.checkpoint_id, checkpoint_type=dest.checkpoint_type,
        tinker_path=str(dest), owner=owner, directory=str(directory), status="ready", size_bytes=source.size_bytes,
        expires_at=utcnow() + timedelta(seconds=ttl) if ttl else None, user_metadata_json=source.user_metadata_json,
    )  # fmt: skip
    try:
        ctx.db.records.add_rows([run, checkpoint])
    except IntegrityError:
        # A concurrent retry of the same request inserted the copy first: answer with its result.
        winner = ctx.db.records.get_run(run_id, owner)
        if winner is None:
            raise
        return _existing_copy(ctx, winner, dest, owner)
    except Exception:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    log.info("copied %s to %s", request.source_path, dest)
    return {"tinker_path": str(dest)}


def _destination(
    ctx: AppContext, request: CopyWeightsRequest, owner: str, idempotency_key: str | None
) -> tuple[str, str]:
    """(session id, run id) of the run that will own the copy."""
    if request.session_id is not None or request.model_seq_id is not None:
        if request.session_id is None:
            user_error("session_id: required together with model_seq_id")
        if request.model_seq_id is None:
            user_error("model_seq_id: required together with session_id")
        if request.model_seq_id < 0:
            user_error(f"model_seq_id: {request.model_seq_id} is negative")
        if ctx.db.records.get_session(request.session_id, owner) is None:
            not_found(f"unknown session_id {request.session_id!r}")
        return request.session_id, f"{request.session_id}:train:{request.model_seq_id}"
    if request.destination_project_id is None:
        user_error("destination_project_id: required unless session_id and model_seq_id are given")
    if idempotency_key:
        digest = hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()[:32]
        copy_id = f"copy-{uuid.UUID(digest)}"
    else:
        copy_id = f"copy-{uuid.uuid4()}"
    return copy_id, f"{copy_id}:train:0"


def _existing_copy(ctx: AppContext, run: TrainingRunRow, dest: TinkerPath, owner: str) -> dict[str, Any]:
    """A retried copy finds its earlier result; any other use of a taken destination is refused. A copy's
    run is the only kind made without a future (`create_model` and create-from-state queue one): a trained
    run, unloaded by a restart, holding a checkpoint of the same name answered as the copy."""
    done = ctx.db.records.get_checkpoint(dest.run_id, dest.checkpoint_id, owner)
    if run.status == "unloaded" and run.future_id is None and done is not None:
        return {"tinker_path": str(dest)}
    user_error(f"the destination training run {run.id!r} already exists; pick an unused model_seq_id")


def _copy_tree(source: Path, dest: Path, source_path: str, owned: Callable[[], bool] = lambda: False) -> None:
    """Copy `source` to `dest` atomically: into a sibling temporary directory, then one rename. A `dest` in
    place is the same copy by a racing retry once a record owns it (`owned`): this one's files go; else it
    is what a copy that died before its records were written left, and is replaced. The stale directory was
    removed up front, which could remove a racing retry's committed copy, and the rename then raised."""
    if not source.is_dir():
        not_found(f"the files of {source_path!r} are missing on the server")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    try:
        shutil.copytree(source, tmp)
        _rename_in(tmp, dest, owned)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, FileNotFoundError | shutil.Error) and not _disk_full(err):  # deleted or swapped
            if not source.is_dir():
                not_found(f"{source_path!r} was deleted while it was being copied")
            raise HTTPException(503, detail=f"{source_path!r} changed while it was being copied; retry") from None
        if isinstance(err, shutil.Error) and _disk_full(err):  # the app answers a full disk 507
            raise OSError(errno.ENOSPC, "no space left on device") from err
        raise


def _rename_in(tmp: Path, dest: Path, owned: Callable[[], bool]) -> None:
    for _ in range(3):
        try:
            os.rename(tmp, dest)
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if owned():  # the racing retry's copy of the same checkpoint, recorded: keep it
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(dest, ignore_errors=True)  # a dead copy's leftovers
    raise OSError(errno.EEXIST, f"{dest.name} keeps being taken")


def _disk_full(err: BaseException) -> bool:
    """Whether a copy failed for space: `copytree` gathers each file's error as text into one `shutil.Error`."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    errors = err.args[0] if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list) else []
    return any("No space left" in str(error) for error in errors)

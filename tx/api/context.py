"""Shared state of one API server and the helpers every route uses.

`AppContext` bundles the settings, the database and what we know about the served model; routes
reach it through the `Ctx` dependency and identify the caller through `Owner` (the `X-API-Key`
header: any `tml-` key when no keys are configured, otherwise one of the configured keys).
`submit` queues a request and shapes the "untyped future" reply; `user_error`/`not_found` raise
HTTP errors whose JSON body names the problem (never an empty 400: the SDK would retry it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel

from tx.api.download_links import DownloadLinks
from tx.api.limits import Limits
from tx.api.models import ModelCatalog, ServedModel
from tx.db import Database, DuplicateRequestError, owner_of
from tx.db.tables import LIVE_SESSION, TrainingRunRow
from tx.protocol import Payload, UnloadModelRequest
from tx.upload_store import GB, UploadStore

T = TypeVar("T")
log = logging.getLogger("tx.api")
DEFAULT_MAX_UPLOAD_GB = 100.0  # a 9B model in float32 with room to spare; --max-upload-gb changes it


@dataclass(frozen=True)
class Settings:
    """Server options (from the CLI)."""

    data_dir: Path = Path("./smolgym-data")
    api_keys: frozenset[str] = frozenset()
    retrieve_hold_s: float = 25.0
    default_max_tokens: int = 512
    max_num_samples: int = 128
    max_topk_logprobs: int = 20
    archive_url_ttl_s: float = 3600.0
    max_upload_bytes: int = int(DEFAULT_MAX_UPLOAD_GB * GB)
    max_runs: int = 256  # training runs per server, every model and owner together (--max-runs)
    max_runs_per_key: int = 128  # one API key's share of them (--max-runs-per-key)


@dataclass
class AppContext:
    settings: Settings
    db: Database
    models: ModelCatalog
    limits: Limits  # server-wide bounds for decoding a body before its model is known; each model has its own
    uploads: UploadStore
    links: DownloadLinks = field(init=False)  # the download links every API process of the server honours
    # Heavy request bodies are decoded and queued on a few threads: dozens of CPU-bound threads
    # fighting over the GIL are slower than a handful, and the group commit batches them anyway.
    heavy_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="tx-submit")
    )
    # Checkpoint copies (whole directories, GBs each) on two threads of their own: on the threads every sync
    # route shares, a tenant's forty copies at once held heartbeats back until sessions expired.
    copy_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tx-copy"))

    async def run_heavy(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.heavy_pool, fn, *args)

    def __post_init__(self) -> None:
        self.links = DownloadLinks(self.settings.data_dir, self.settings.archive_url_ttl_s)

    def issue_download(self, directory: Path) -> str:
        """An unauthenticated token for downloading `directory` (as a tar archive, or file by file), good for
        half to all of `archive_url_ttl_s` on every API process (`tx.api.download_links`)."""
        return self.links.issue(directory)[0]


def get_ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


Ctx = Annotated[AppContext, Depends(get_ctx)]


def get_owner(ctx: Ctx, x_api_key: Annotated[str | None, Header()] = None) -> str:
    if not x_api_key:
        raise HTTPException(401, detail="missing X-API-Key header")
    owner = known_owner(ctx, x_api_key)
    if owner is None:
        raise HTTPException(401, detail="invalid API key (set TINKER_API_KEY to a key this server accepts)")
    return owner


def known_owner(ctx: AppContext, x_api_key: str | None) -> str | None:
    """The owner hash of an accepted key, or None."""
    if not x_api_key:
        return None
    allowed = ctx.settings.api_keys
    if (allowed and x_api_key not in allowed) or (not allowed and not x_api_key.startswith("tml-")):
        return None
    return owner_of(x_api_key)


Owner = Annotated[str, Depends(get_owner)]


def user_error(message: str) -> NoReturn:
    raise HTTPException(400, detail=message)


def not_found(message: str) -> NoReturn:
    raise HTTPException(404, detail=message)


def future_reply(future_id: str, model_id: str | None = None, sequence_ids: list[str] | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"request_id": future_id}
    if model_id is not None:
        reply["model_id"] = model_id
    if sequence_ids:
        reply["sample_sequence_ids"] = sequence_ids
    return reply


def submit(
    ctx: AppContext,
    *,
    kind: str,
    payload: Payload,
    owner: str,
    model_id: str | None,
    seq_id: int | None = None,
    dedupe_key: str | None = None,
    sequence_ids: list[str] | None = None,
    rows: list[SQLModel] | None = None,
) -> dict[str, Any]:
    """Queue one request and return the future reply (blocking: call from a worker thread). A row it would
    create that already exists is a 400 naming it, unless a concurrent retry of the same request made it
    (then this is that retry, answered with its future)."""
    queue = functools.partial(
        ctx.db.queue.submit, kind=kind, payload=payload, owner=owner, model_id=model_id, seq_id=seq_id,
        dedupe_key=dedupe_key, sequence_ids=sequence_ids or [], rows=rows or [],
    )  # fmt: skip
    try:
        try:
            submitted = queue()
        except IntegrityError:
            if dedupe_key is None or ctx.db.queue.get_by_key(dedupe_key) is None:
                user_error(f"{_names(rows or [])} already exists; pick an unused model_seq_id, "
                           "sampling_session_seq_id or checkpoint name")  # fmt: skip
            submitted = queue()
    except DuplicateRequestError as exc:
        user_error(str(exc))
    return future_reply(submitted.future_id, model_id if kind != "sample" else None, submitted.sequence_ids)


def unload_ended(ctx: AppContext, runs: list[TrainingRunRow], why: str) -> None:
    """Queue an unload for each run of a finished or expired session. Keyed per run, so the finish route and
    the reaper (which queues whatever a failed earlier call left loaded) never queue two for one run."""
    for run in runs:
        log.info("session %s %s: unloading %s", run.session_id, why, run.id)
        submit(ctx, kind="unload_model", payload=UnloadModelRequest(), owner=run.owner, model_id=run.id,
               dedupe_key=f"{run.id}#unload")  # fmt: skip


def _names(rows: list[SQLModel]) -> str:
    """What a request's new rows are to its caller: 'training run 's:train:3'', 'sampler ...'."""
    kinds = {"training_runs": "training run", "sampling_sessions": "sampler", "sampler_snapshots": "sampler weights",
             "checkpoints": "checkpoint"}  # fmt: skip
    names = [getattr(r, "tinker_path", None) or getattr(r, "id", None) for r in rows]
    named = [f"{kinds.get(str(r.__tablename__), 'a record')} {name!r}" for r, name in zip(rows, names, strict=True)]
    return " or ".join(dict.fromkeys(named)) or "a record of this request"


def run_model(ctx: AppContext, run: TrainingRunRow) -> ServedModel:
    """The base model of one of the caller's runs."""
    return ctx.models.get(run.owner, run.base_model)


def usable_run(ctx: AppContext, model_id: str, owner: str, new_work: bool = True) -> TrainingRunRow:
    """The caller's training run, or a 4xx explaining why it cannot take requests; `new_work` False (an unload)
    also takes a run of an ended session, whose unload the reaper would queue anyway."""
    run = ctx.db.records.get_run(model_id, owner)
    if run is None:
        not_found(f"unknown model_id {model_id!r}")
    if run.status == "failed":
        user_error(f"model {model_id!r} failed to be created; see the create_model error")
    if run.status == "unloaded":
        user_error(
            f"model {model_id!r} is unloaded (its session finished or expired, the server restarted, or"
            " unload_model was called); load a checkpoint to continue"
        )
    session = ctx.db.records.get_session(run.session_id, owner) if run.session_id and new_work else None
    if session is not None and session.status not in LIVE_SESSION:  # its runs unload at the reaper's next turn
        user_error(
            f"model {model_id!r} belongs to session {run.session_id!r}, which has {session.status} (an expired one "
            "missed its heartbeats); create a new session and load a checkpoint to continue"
        )
    return run

"""FastAPI application factory: `create_app(settings, db, models)`.

The app only validates, queues and serves results; the engine that executes the queue is started
next to it by the caller (`python -m tx.api`, or a test fixture with a fake runner). A background
task expires sessions whose heartbeats stopped and unloads their runs' adapters. Decoding and
validation errors become HTTP 400 with a `detail` naming the field; 422 (schema) errors keep
FastAPI's field-by-field detail.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError

from tx.api import (
    routes_admin,
    routes_copy,
    routes_futures,
    routes_rest,
    routes_sample,
    routes_search,
    routes_session,
    routes_train,
    routes_upload,
    routes_weights,
)
from tx.api.body_limit import BodyLimit, BodyTooLarge
from tx.api.context import AppContext, Settings, unload_ended
from tx.api.limits import Limits
from tx.api.models import ModelCatalog
from tx.api.validate import ValidationError
from tx.api.wire_decode import WireError
from tx.db import Database
from tx.db.queue import DROP_BATCH
from tx.names import BadName
from tx.protocol import ModelInfo
from tx.upload_store import UploadStore

log = logging.getLogger("tx.api")


async def _bad_request(_request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=400)


async def _too_large(_request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=413)


async def _store_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    """The database refused the request's read or write (a full disk, a lost Postgres, a held lock): a 503 the
    SDK retries, naming the cause, instead of a 500 with a traceback."""
    cause = str(getattr(exc, "orig", exc))
    log.error("database unavailable: %s", cause)
    why = "its disk is full" if "full" in cause else "try again shortly"
    detail = f"the server's database cannot serve this request ({why})"
    return JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": "1"})


async def _unstorable(_request: Request, exc: Exception) -> JSONResponse:
    """The database refused a value the request carried (Postgres takes no NUL character in text): the
    caller's input, a 400, not a 500 the SDK would retry."""
    log.info("a request value the database refused: %s", getattr(exc, "orig", exc))
    detail = "the request holds a value the database cannot store (a NUL character in a name or id?)"
    return JSONResponse({"detail": detail}, status_code=400)


async def _disk_full(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        log.error("disk full: %s", exc)
        return JSONResponse({"detail": "the server's disk is full; free space in its data directory"}, status_code=507)
    raise exc


MAX_ERRORS_SHOWN = 10


async def _schema_error(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's field-by-field 422, with each offending input shown by its repr: an input such as NaN
    cannot be rendered as strict JSON, and a 500 here would make the SDK retry a request that cannot pass."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    detail = [{**error, "input": repr(error.get("input"))[:200]} for error in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:  # each of 100,000 bad items is an error: megabytes, encoded on the loop
        detail.append({"type": "more", "loc": [], "msg": f"and {len(errors) - MAX_ERRORS_SHOWN} more errors"})
    return JSONResponse({"detail": jsonable_encoder(detail, custom_encoder={float: repr})}, status_code=422)


def reap_sessions(ctx: AppContext) -> int:
    """Expire sessions whose heartbeats stopped and queue an unload for each of their loaded runs, and for any
    run an earlier finish or expiry left loaded (its queueing failed part-way); drop results past their
    retention (`SqlQueue.drop_old_results`). Returns the unloads queued."""
    ctx.db.records.expire_sessions()
    runs = ctx.db.records.stranded_runs()
    unload_ended(ctx, runs, "ended")
    deadline = time.monotonic() + 5.0  # a busy server finishes more than a batch a tick: keep up, briefly
    while ctx.db.queue.drop_old_results(batch=DROP_BATCH) == DROP_BATCH and time.monotonic() < deadline:
        pass
    return len(runs)


async def _reaper(ctx: AppContext) -> None:
    interval = max(1.0, min(60.0, ctx.db.records.session_timeout.total_seconds() / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(reap_sessions, ctx)
            await run_in_threadpool(routes_rest.sweep_expired_checkpoints, ctx.db.records, ctx.settings.data_dir)
        except Exception:
            log.exception("session and checkpoint reaper failed")


def server_limits(models: ModelCatalog) -> Limits:
    """Bounds for a body whose model is not known yet: the longest sequence any model may take, and
    top-K targets as wide as the limit allows; each model's own limits are checked once it is known."""
    if models.fixed:
        return next(iter(models.preloaded.values())).limits
    return Limits(max_seq_len=models.rules.max_seq_len, vocab_size=1 << 30)


def create_app(
    settings: Settings, db: Database, models: ModelCatalog | ModelInfo, uploads: UploadStore | None = None
) -> FastAPI:
    """`models`: the catalog of base models; a bare `ModelInfo` serves that one model (tests, fake engines).
    `uploads`: the upload store (default: `<data-dir>/uploads`); a catalog without upload hooks gets its."""
    catalog = ModelCatalog.single(models) if isinstance(models, ModelInfo) else models
    store = uploads or UploadStore(settings.data_dir / "uploads", settings.max_upload_bytes)
    if catalog.find_upload is None and catalog.list_uploads is None:
        catalog.find_upload, catalog.list_uploads = store.find_upload, store.list_uploads
    ctx = AppContext(settings, db, catalog, server_limits(catalog), store)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_reaper(ctx))
        yield
        task.cancel()
        ctx.heavy_pool.shutdown(wait=False)
        ctx.copy_pool.shutdown(wait=False)

    app = FastAPI(title="SmolGym", description="Tinker-compatible training and sampling server", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_exception_handler(WireError, _bad_request)
    app.add_exception_handler(ValidationError, _bad_request)
    app.add_exception_handler(BadName, _bad_request)
    app.add_exception_handler(BodyTooLarge, _too_large)
    app.add_exception_handler(RequestValidationError, _schema_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
    app.add_exception_handler(DataError, _unstorable)
    app.add_exception_handler(OSError, _disk_full)
    app.add_middleware(BodyLimit, max_bytes=ctx.limits.max_body_bytes, max_containers=ctx.limits.max_json_containers)
    for module in (
        routes_session,
        routes_train,
        routes_weights,
        routes_sample,
        routes_futures,
        routes_rest,
        routes_admin,
        routes_copy,
        routes_search,
        routes_upload,
    ):
        app.include_router(module.router)
    return app

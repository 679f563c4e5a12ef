"""FastAPI application factory: `create_app(settings, db, model_info)`.

The app only validates, queues and serves results; the engine that executes the queue is started
next to it by the caller (`python -m tx.api`, or a test fixture with a fake runner). Decoding and
validation errors become HTTP 400 with a `detail` naming the field; 422 (schema) errors keep
FastAPI's field-by-field detail.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tx.api import routes_futures, routes_rest, routes_sample, routes_session, routes_train, routes_weights
from tx.api.context import AppContext, Settings
from tx.api.validate import ValidationError
from tx.api.wire_decode import WireError
from tx.db import Database
from tx.protocol import ModelInfo

log = logging.getLogger("tx.api")


async def _bad_request(_request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=400)


def create_app(settings: Settings, db: Database, model_info: ModelInfo) -> FastAPI:
    app = FastAPI(title="SmolGym", description="Tinker-compatible training and sampling server")
    app.state.ctx = AppContext(settings, db, model_info)
    app.add_exception_handler(WireError, _bad_request)
    app.add_exception_handler(ValidationError, _bad_request)
    for module in (routes_session, routes_train, routes_weights, routes_sample, routes_futures, routes_rest):
        app.include_router(module.router)
    return app

"""`POST /retrieve_future`: the long poll every SDK call ends in.

The route holds the request until the future finishes (woken by the engine's completion, not by
polling) or `retrieve_hold_s` (25 s, below the client's 45 s timeout) passes, then answers 408 with
a JSON body, which the SDK re-polls at once. Failures are HTTP 200 `{"error", "category"}` (the SDK
raises `RequestFailedError`). Results stay stored, so a repeated poll gets the same answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from tx.api.context import Ctx, Owner, not_found
from tx.api.schemas import RetrieveFutureRequest
from tx.api.wire_encode import result_json, result_proto, wants_proto
from tx.db import codec
from tx.db.tables import FutureRow

router = APIRouter(prefix="/api/v1")
log = logging.getLogger("tx.api")

PROTO_MEDIA_TYPE = "application/x-protobuf"


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, request: Request, ctx: Ctx, owner: Owner) -> Response:
    row = await ctx.db.queue.wait_finished(body.request_id, ctx.settings.retrieve_hold_s, owner)
    if row is None or row.owner != owner:
        not_found(f"unknown request_id {body.request_id!r}")
    if row.status == "failed":
        return JSONResponse({"error": row.error or "request failed", "category": row.error_category or "unknown"})
    if row.status != "done":
        pending = {"detail": "request still pending", "type": "try_again", "request_id": body.request_id}
        return JSONResponse({**pending, "queue_state": "active"}, status_code=408)
    return await run_in_threadpool(_render, row, request.headers.get("accept"))


def _render(row: FutureRow, accept: str | None) -> Response:
    """Encode a stored result. Never raise: a 5xx here would make the SDK re-poll in a tight loop."""
    try:
        result = codec.decode(row.result or b"")
        if wants_proto(accept, result):
            return Response(result_proto(result), media_type=PROTO_MEDIA_TYPE)
        payload: dict[str, Any] = result_json(result)
        return NumbersJSONResponse(payload)
    except Exception as exc:
        log.exception("could not encode the result of future %s", row.id)
        return JSONResponse({"error": f"the server could not encode this result: {exc}", "category": "server"})


class NumbersJSONResponse(JSONResponse):
    """JSON that keeps non-finite floats as `NaN` / `Infinity` / `-Infinity`: what Python's `json` (and so
    the SDK, through httpx) reads back as the same float. A NaN loss is a result, not an encoding error."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode("utf-8")

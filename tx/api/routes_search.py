"""`POST /sessions/search` (SDK 0.36+ `RestClient.search_sessions`, experimental).

Filters the caller's sessions, newest first, and pages with a `(created_at, session_id)` cursor.
What maps onto SmolGym's records is supported: `session_id`, `user_metadata`, `statuses` (active,
client_finished with reasons; SmolGym never cancels or fails a session, so those match nothing),
`owner` (one API key = one owner: `own` and `accessible` both mean the caller's sessions, `user`
matches when the caller's owner id is listed), `limit` and `cursor`. SmolGym keeps no projects and
no session display names, so `project_ids` and `display_name` are refused with a 400 saying so.
Every session reports `project_id` "default".
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from tx.api.context import Ctx, Owner, user_error
from tx.api.routes_copy import parse_body
from tx.api.schemas import MetadataFilter
from tx.db.records import Records
from tx.db.tables import LIVE_SESSION, SessionRow

router = APIRouter(prefix="/api/v1")

DEFAULT_PROJECT = "default"
FINISH_REASONS = ("success", "errored", "interrupted")
SCAN_BATCH = 200  # sessions read per query while filtering


class _Owner(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(default=None, min_length=1, max_length=10)


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1, max_length=8)


class _Cursor(BaseModel):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(BaseModel):
    """SDK 0.38 `SessionSearchRequest` (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    session_id: str | None = None
    project_ids: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=256)
    user_metadata: MetadataFilter = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: _Owner = Field(default_factory=_Owner)
    statuses: list[_Status] | None = Field(default=None, min_length=1, max_length=8)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: _Cursor | None = None


@router.post("/sessions/search")
def search_sessions(ctx: Ctx, owner: Owner, body: Annotated[Any, Body()] = None) -> dict[str, Any]:
    request: SessionSearchRequest = parse_body(SessionSearchRequest, body)
    if request.project_ids is not None:
        user_error("project_ids: SmolGym has no projects (one API key = one owner); omit project_ids")
    if request.display_name is not None:
        user_error("display_name: SmolGym does not store session display names; search by session_id or user_metadata")
    if request.owner.type == "user":
        if not request.owner.owner_urns:
            user_error("owner.owner_urns: required (1 to 10 owner ids) when owner.type is 'user'")
        if owner not in request.owner.owner_urns:
            return {"sessions": [], "next_cursor": None}  # other owners' sessions are never visible

    after = None
    if request.cursor is not None:
        try:
            after = (request.cursor.last_created_at.astimezone(UTC), request.cursor.last_session_id)
        except OverflowError:  # year 1 at +05:00 lies before datetime's range in UTC
            user_error(f"cursor.last_created_at {request.cursor.last_created_at} is outside the datetime range in UTC")
    rows = list(itertools.islice(_matching(ctx.db.records, owner, request, after), request.limit + 1))
    page = rows[: request.limit]
    stats = ctx.db.records.session_checkpoint_stats(owner, [row.id for row in page])
    next_cursor = None
    if len(rows) > request.limit:
        last = page[-1]
        next_cursor = {"last_created_at": _iso(_created(last)), "last_session_id": last.id}
    return {"sessions": [_summary(row, owner, stats.get(row.id, (0, 0))) for row in page], "next_cursor": next_cursor}


def _matching(
    records: Records, owner: str, request: SessionSearchRequest, after: tuple[datetime, str] | None
) -> Iterator[SessionRow]:
    """The owner's sessions that match, newest first, read `SCAN_BATCH` rows at a time: an owner's whole
    history (each with up to 64 KiB of metadata) is never in memory at once."""
    while True:
        batch = records.owner_sessions(owner, before=after, session_id=request.session_id, limit=SCAN_BATCH)
        yield from (row for row in batch if _matches(row, request))
        if len(batch) < SCAN_BATCH:
            return
        after = (_created(batch[-1]), batch[-1].id)


def _matches(row: SessionRow, request: SessionSearchRequest) -> bool:
    if request.session_id is not None and row.id != request.session_id:
        return False
    if request.user_metadata:
        meta = _metadata(row)
        if any(meta.get(key) != value for key, value in request.user_metadata.items()):
            return False
    if request.statuses is not None:
        return any(_status_matches(row, query) for query in request.statuses)
    return True


def _status_matches(row: SessionRow, query: _Status) -> bool:
    if query.type == "active":
        return row.status in LIVE_SESSION
    if query.type == "client_finished":
        reason = row.finish_reason
        return row.status == "finished" and reason in FINISH_REASONS and (not query.reasons or reason in query.reasons)
    return False  # cancelled / failed: SmolGym never ends a session that way


def _metadata(row: SessionRow) -> dict[str, str]:
    raw = json.loads(row.user_metadata_json) or {}
    return {str(key): value if isinstance(value, str) else json.dumps(value) for key, value in raw.items()}


def _created(row: SessionRow) -> datetime:
    moment = row.created_at
    return moment.astimezone(UTC) if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _summary(row: SessionRow, owner: str, stats: tuple[int, int]) -> dict[str, Any]:
    status: dict[str, Any] | None = None
    if row.status in LIVE_SESSION:
        status = {"type": "active"}
    elif row.status == "finished" and row.finish_reason in FINISH_REASONS:
        status = {"type": "client_finished", "reason": {"type": row.finish_reason}}
    meta = _metadata(row)
    return {
        "session_id": row.id,
        "created_at": _iso(_created(row)),
        "owner": owner,
        "project_id": DEFAULT_PROJECT,
        "status": status,
        "checkpoints_count": stats[0],
        "display_name": None,
        "user_metadata": meta or None,
        "checkpoint_storage_bytes": stats[1],
    }

"""Bootstrap and session endpoints: client config, health, capabilities, telemetry, sessions.

`POST /client/config` is mandatory for SDK 0.18+; the flags we return route every SDK version from
0.19 on through the 0.38 code paths (protobuf forward_backward, forward via `forward_only`,
create-via-load). Heartbeats of finished or expired sessions get HTTP 410, which stops the
client's heartbeat loop.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Response

from tx.api.context import Ctx, Owner, known_owner, not_found, unload_ended
from tx.api.schemas import (
    ClientConfigRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    PageLimit,
    PageOffset,
    ProjectRequest,
    SessionRef,
)
from tx.protocol import ModelInfo

log = logging.getLogger("tx.api")

router = APIRouter(prefix="/api/v1")

CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "proto_write_fwdbwd": True,
    "fwd_via_fwdbwd": True,
    "proto_compress_fwdbwd": False,
    "create_model_via_load_weights": True,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


@router.post("/client/config")
def client_config(_body: ClientConfigRequest, ctx: Ctx, _owner: Owner) -> dict[str, Any]:
    # The SDK cuts forward_backward into requests of at most this many datums and (estimated) bytes.
    chunks = {"fwdbwd_max_chunk_len": ctx.limits.max_datums, "fwdbwd_max_chunk_bytes_count": ctx.limits.sdk_chunk_bytes}
    return {**CLIENT_CONFIG, **chunks}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(ctx: Ctx, x_api_key: Annotated[str | None, Header()] = None) -> dict[str, Any]:
    """Every model the caller can use now: preloaded, loaded on demand, and their own uploads (a request
    without a key sees no uploads)."""
    usable = ctx.models.usable(known_owner(ctx, x_api_key))
    return {"supported_models": [_model_entry(m.info) for m in usable]}


def _model_entry(info: ModelInfo) -> dict[str, Any]:
    return {
        "model_name": info.base_model,
        "max_context_length": info.max_seq_len,
        "trainable": True,
        "sampleable": True,
    }


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(body: CreateSessionRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    session_id = ctx.db.records.create_session(owner, body.tags, body.user_metadata or {}, body.sdk_version)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionRef, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    state = ctx.db.records.heartbeat(body.session_id, owner)
    if state == "missing":
        not_found(f"unknown session_id {body.session_id!r}")
    if state == "gone":
        raise HTTPException(410, detail=f"session {body.session_id!r} is finished or expired")
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: FinishSessionRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    """Finish the session and free it like expiry does: each still-loaded run gets an unload queued (if that
    fails part-way, a retry finds the session finished and the reaper queues the rest)."""
    runs = ctx.db.records.finish_session(session_id, owner, body.reason.type)
    if runs is None:
        not_found(f"unknown session_id {session_id!r}")
    unload_ended(ctx, runs, f"finished ({body.reason.type!r})")  # repr: the text is the caller's
    return {"session_id": session_id, "status": "finished"}


@router.get("/sessions")
def list_sessions(ctx: Ctx, owner: Owner, limit: PageLimit = 20, offset: PageOffset = 0) -> dict[str, Any]:
    return {"sessions": ctx.db.records.list_sessions(owner, limit, offset)}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    row = ctx.db.records.get_session(session_id, owner)
    if row is None:
        not_found(f"unknown session_id {session_id!r}")
    runs, samplers = ctx.db.records.session_children(session_id)
    return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": json.loads(row.user_metadata_json)}


@router.put("/sessions/{session_id}/project", status_code=204)
def assign_session_project(session_id: str, body: ProjectRequest, ctx: Ctx, owner: Owner) -> Response:
    """Projects are not a SmolGym concept (one key = one owner); accept the call for an owned session."""
    if ctx.db.records.get_session(session_id, owner) is None:
        not_found(f"unknown session_id {session_id!r}")
    log.info("session %s: project %r noted (SmolGym has no projects)", session_id, body.project_id)
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export")
def export_session_trace(session_id: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    """SmolGym records no Perfetto traces: answer `failed` (the client stops polling and reports it)."""
    if ctx.db.records.get_session(session_id, owner) is None:
        not_found(f"unknown session_id {session_id!r}")
    return {"status": "failed", "error": "SmolGym does not record session traces"}

"""Training endpoints that queue work: create_model, forward_backward, forward, optim_step, unload.

`forward_backward` takes a protobuf body (optionally zstd) from SDK 0.19+ and JSON from older ones;
`/forward` is the legacy JSON forward. Every body is decoded and validated here, so the queue only
ever holds requests the engine can run. Model ids are `{session_id}:train:{model_seq_id}`, and a
run's requests are deduplicated by `(model_id, seq_id)`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from tx.api import schemas, validate
from tx.api.context import AppContext, Ctx, Owner, not_found, run_model, submit, usable_run, user_error
from tx.api.wire_decode import WireError, decompress, parse_forward_backward_json, parse_forward_backward_proto
from tx.db.tables import LIVE_SESSION, TrainingRunRow
from tx.protocol import (
    DEFAULT_LORA_ALPHA,
    AdamParams,
    CreateModelRequest,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    Payload,
    UnloadModelRequest,
)

router = APIRouter(prefix="/api/v1")


def _seq_key(model_id: str, seq_id: int | None) -> str | None:
    return f"{model_id}#{seq_id}" if seq_id else None


@router.post("/create_model")
def create_model(body: schemas.CreateModelRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    if body.session_id is not None:
        check_live_session(ctx, body.session_id, owner)
    served = ctx.models.get(owner, body.base_model)
    lora_in = body.lora_config
    if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
        user_error(f"optimizer_config.type {body.optimizer_config.type!r} is not supported (only 'adamw')")
    lora: LoraConfig | None = None  # rank 0 asks for full fine-tuning: every weight is trained
    if lora_in.rank != 0:
        validate.check_lora_rank(lora_in.rank, served.info)
        if not (lora_in.train_attn or lora_in.train_mlp or lora_in.train_unembed):
            user_error("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        lora = LoraConfig(
            lora_in.rank, DEFAULT_LORA_ALPHA, lora_in.train_attn, lora_in.train_mlp, lora_in.train_unembed, lora_in.seed
        )
    session_id = body.session_id or _open_session(ctx, owner)
    model_id = f"{session_id}:train:{body.model_seq_id}"
    run = new_run_row(model_id, session_id, owner, body.base_model, lora, body.user_metadata or {})
    payload = CreateModelRequest(served.info.base_model, lora, body.user_metadata or {}, served.model_dir)
    return submit_new_run(ctx, run, "create_model", payload)


def submit_new_run(ctx: AppContext, run: TrainingRunRow, kind: str, payload: Payload) -> dict[str, Any]:
    """Queue the request that creates `run`, its limits checked and its row inserted as one step
    (`Records.run_creation`): checked apart, creates racing each other all found room."""
    with ctx.db.records.run_creation():
        check_run_limit(ctx, run.id, run.owner)
        return submit(
            ctx, kind=kind, payload=payload, owner=run.owner, model_id=run.id, dedupe_key=f"{run.id}#create", rows=[run]
        )


def check_live_session(ctx: AppContext, session_id: str, owner: str) -> None:
    session = ctx.db.records.get_session(session_id, owner)
    if session is None:
        not_found(f"unknown session_id {session_id!r}")
    if session.status not in LIVE_SESSION:
        user_error(f"session {session_id!r} is {session.status}; start a new ServiceClient")


def _open_session(ctx: AppContext, owner: str) -> str:
    """A session for a run created without one (SDK 0.1-0.2, before sessions): `open`, it needs no heartbeats;
    its runs stay until unload_model, or until none was sent work for `--open-session-timeout`. Made only once
    the request passed every check, the run limit too."""
    check_run_limit(ctx, "", owner)
    return ctx.db.records.create_session(owner, ["sessionless"], {}, None, status="open")


def check_run_limit(ctx: AppContext, model_id: str, owner: str) -> None:
    """--max-runs bounds the server's live training runs and --max-runs-per-key one key's share of them; a
    retried create of an accepted run is not a new one."""
    limit, share = ctx.settings.max_runs, ctx.settings.max_runs_per_key
    if ctx.db.records.get_run(model_id, owner) is not None:
        return
    if ctx.db.records.live_run_count(owner) >= share:
        user_error(
            f"this API key already holds {share} training runs, its share of the server (--max-runs-per-key "
            f"{share}); unload a run or let an idle session expire"
        )
    if ctx.db.records.live_run_count() >= limit:
        user_error(
            f"this server already holds {limit} training runs, its limit (--max-runs {limit}); unload a run, "
            f"let an idle session expire, or restart the server with a higher --max-runs"
        )


def new_run_row(
    model_id: str, session_id: str, owner: str, base_model: str, lora: LoraConfig | None, meta: dict[str, str]
) -> TrainingRunRow:
    return TrainingRunRow(
        id=model_id,
        session_id=session_id,
        owner=owner,
        base_model=base_model,
        lora_rank=lora.rank if lora else None,
        lora_alpha=lora.alpha if lora else None,
        train_attn=lora.train_attn if lora else True,
        train_mlp=lora.train_mlp if lora else True,
        train_unembed=lora.train_unembed if lora else True,
        user_metadata_json=json.dumps(meta),
    )


@router.post("/get_info")
def get_info(body: schemas.ModelRef, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    run = ctx.db.records.get_run(body.model_id, owner)
    if run is None:
        not_found(f"unknown model_id {body.model_id!r}")
    info = run_model(ctx, run).info
    model_data = {"model_name": run.base_model, "tokenizer_id": info.tokenizer_id, "arch": info.arch or None}
    reply: dict[str, Any] = {"model_id": run.id, "model_data": model_data, "is_lora": run.lora_rank is not None}
    if run.lora_rank is not None:
        reply["lora_rank"] = run.lora_rank
    reply.update(model_name=run.base_model, optimizer_config={"type": "adamw"}, type="get_info")
    return reply


@router.post("/forward_backward")
async def forward_backward(request: Request, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    raw = await request.body()
    if "application/x-protobuf" in request.headers.get("content-type", ""):
        encoding = request.headers.get("content-encoding")
        return await ctx.run_heavy(_accept_proto_pass, ctx, owner, raw, encoding)
    return await ctx.run_heavy(_accept_json_pass, ctx, owner, raw, "forward_backward_input")


@router.post("/forward")
async def forward(request: Request, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    return await ctx.run_heavy(_accept_json_pass, ctx, owner, await request.body(), "forward_input")


def _accept_proto_pass(ctx: AppContext, owner: str, raw: bytes, encoding: str | None) -> dict[str, Any]:
    body = decompress(raw, encoding, ctx.limits.max_body_bytes)
    del raw  # the compressed copy is not needed while the body is parsed
    message, payload = parse_forward_backward_proto(body, ctx.limits)
    return _accept_pass(ctx, owner, message.model_id, int(message.seq_id), payload)


def _accept_json_pass(ctx: AppContext, owner: str, raw: bytes, key: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also an integer past 4300 digits, or nesting past the stack
        raise WireError(f"body is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("model_id"), str):
        raise WireError("body must be a JSON object with a string 'model_id'")
    seq_id = body.get("seq_id")
    if seq_id is not None and (type(seq_id) is not int or not -(1 << 63) <= seq_id < 1 << 63):
        raise WireError(f"seq_id must be a 64-bit integer, got {str(seq_id)[:40]}")
    payload = parse_forward_backward_json(body, key, ctx.limits)
    return _accept_pass(ctx, owner, body["model_id"], seq_id, payload)


def _accept_pass(
    ctx: AppContext, owner: str, model_id: str, seq_id: int | None, payload: ForwardBackwardRequest
) -> dict[str, Any]:
    """Check and queue a forward or forward_backward (runs in a worker thread)."""
    if not model_id:
        raise WireError("missing model_id")
    served = run_model(ctx, usable_run(ctx, model_id, owner))
    validate.check_forward_backward(payload, served.info, served.limits)
    kind = "forward" if payload.forward_only else "forward_backward"
    return submit(
        ctx,
        kind=kind,
        payload=payload,
        owner=owner,
        model_id=model_id,
        seq_id=seq_id,
        dedupe_key=_seq_key(model_id, seq_id),
    )


@router.post("/optim_step")
def optim_step(body: schemas.OptimStepRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    if body.optimizer_params is not None:
        kind = body.optimizer_params.get("type", "unknown")
        user_error(f"optimizer {kind!r} is not supported; use adam_params (AdamW)")
    params = body.adam_params or body.optim_params or schemas.AdamParamsIn()
    adam = AdamParams(**params.model_dump())
    validate.check_adam(adam)
    usable_run(ctx, body.model_id, owner)
    return submit(
        ctx,
        kind="optim_step",
        payload=OptimStepRequest(adam),
        owner=owner,
        model_id=body.model_id,
        seq_id=body.seq_id,
        dedupe_key=_seq_key(body.model_id, body.seq_id),
    )


@router.post("/unload_model")
def unload_model(body: schemas.ModelRef, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    usable_run(ctx, body.model_id, owner, new_work=False)
    return submit(ctx, kind="unload_model", payload=UnloadModelRequest(), owner=owner, model_id=body.model_id)

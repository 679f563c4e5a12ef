"""Sampling endpoints: create_sampling_session, samplers/{id}, asample.

A sampling session pins the weights it samples: the base model, a named checkpoint (sampler or
training) or an ephemeral snapshot made by `save_weights_for_sampler`. `asample` answers with the
future id and `sample_sequence_ids` (one per requested sample, required by SDK 0.26+); samples are
deduplicated by `(sampling_session_id, seq_id)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from typing import Any

from fastapi import APIRouter

from tx.api import schemas, validate
from tx.api.context import AppContext, Ctx, Owner, not_found, submit, user_error
from tx.api.paths import parse_tinker_path
from tx.api.routes_weights import resolve_checkpoint
from tx.api.wire_decode import model_input_tokens, sampling_params
from tx.db.tables import SamplingSessionRow
from tx.protocol import SampleRequest, WeightsRef, inflight_snapshot_id

router = APIRouter(prefix="/api/v1")

_UNSUPPORTED = {
    "topk_sample_logprobs": lambda b: b.topk_sample_logprobs > 0,
    "target_prompt_logprobs": lambda b: b.target_prompt_logprobs is not None,
    "prompt_alt_tokens_k": lambda b: b.prompt_alt_tokens_k > 0,
}
# `record_stability_info` (0.27+, set by `save_weights_and_get_sampling_client(record_stability_info=True)`
# for stable_reinforce) is accepted and ignored: our stable_reinforce needs only the sampling logprobs,
# which every datum carries, so there is nothing to record.


@router.post("/create_sampling_session")
def create_sampling_session(body: schemas.CreateSamplingSessionRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    if ctx.db.records.get_session(body.session_id, owner) is None:
        not_found(f"unknown session_id {body.session_id!r}")
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    row = _pinned(ctx, SamplingSessionRow(id=sampler_id, session_id=body.session_id, owner=owner, base_model=""),
                  body.model_path, body.base_model)  # fmt: skip
    kept = ctx.db.records.add_sampling_session(row)
    if (kept.model_path, kept.base_model) != (row.model_path, row.base_model):  # not a retry of the same create
        user_error(
            f"sampling_session_seq_id {body.sampling_session_seq_id} of this session already names a sampler of "
            f"{kept.model_path or kept.base_model!r}; use an unused sampling_session_seq_id"
        )
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


def _pinned(ctx: AppContext, row: SamplingSessionRow, model_path: str | None, base: str | None) -> SamplingSessionRow:
    """`row` with the weights it samples: the checkpoint at `model_path`, else the base model."""
    if model_path:
        path, ckpt = resolve_checkpoint(ctx, model_path, row.owner)
        if ckpt.checkpoint_type == "training":  # a training state holds no sampler weights the engine can load
            user_error(
                f"model_path {model_path!r} is a training state (weights/...): sample from a sampler checkpoint "
                "(save_weights_for_sampler), or load the state into a training client first"
            )
        row.model_path, row.model_id, row.snapshot_id = str(path), path.run_id, str(path)
        row.checkpoint_dir, row.checkpoint_type = ckpt.directory, ckpt.checkpoint_type
        source = ctx.db.records.get_run(path.run_id, row.owner)
        if source is None:
            not_found(f"the training run of {model_path!r} no longer exists")
        row.base_model = source.base_model
    else:
        row.base_model = base or _only_model(ctx)
    ctx.models.get(row.owner, row.base_model)  # located and allowed now: a bad name fails here, not at sample time
    return row


def _sessionless(ctx: AppContext, body: schemas.SampleRequest, owner: str) -> SamplingSessionRow:
    """The sampler of a request from an SDK before sampling sessions (0.1-0.2), which names its weights in
    each request: one stored sampler per owner and (model_path, base_model), made at first use."""
    if not (body.model_path or body.base_model):
        user_error("sampling_session_id is required (or, from an SDK before 0.3, model_path or base_model)")
    key = hashlib.sha256(f"{owner}\0{body.model_path or ''}\0{body.base_model or ''}".encode()).hexdigest()[:24]
    sampler_id = f"sessionless-{key}:sample:0"
    row = ctx.db.records.get_sampling_session(sampler_id, owner)
    if row is not None:
        return row
    row = SamplingSessionRow(id=sampler_id, session_id=f"sessionless-{key}", owner=owner, base_model="")
    return ctx.db.records.add_sampling_session(_pinned(ctx, row, body.model_path, body.base_model))


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    row = ctx.db.records.get_sampling_session(sampler_id, owner)
    if row is None:
        not_found(f"unknown sampler_id {sampler_id!r}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


def _only_model(ctx: AppContext) -> str:
    """The base model of a sampling session that names none: the server's one preloaded model."""
    if len(ctx.models.preloaded) != 1:
        user_error("create_sampling_session needs a base_model or a model_path (this server has several models)")
    return next(iter(ctx.models.preloaded))


def _weights_of(ctx: AppContext, sampler: SamplingSessionRow) -> WeightsRef | None:
    if sampler.snapshot_id is None:
        return None
    if sampler.model_path is not None:  # a named checkpoint's sampler samples while the checkpoint exists
        path = parse_tinker_path(sampler.model_path)
        found = path and ctx.db.records.get_checkpoint(path.run_id, path.checkpoint_id, sampler.owner, or_replaced=True)
        if not found:
            not_found(f"checkpoint {sampler.model_path!r} was deleted or has expired: its sampler has no weights")
    if sampler.checkpoint_dir is None:  # ephemeral: exists only once its save succeeded
        inflight = sampler.model_id is not None and sampler.snapshot_id == inflight_snapshot_id(sampler.model_id)
        snapshot = ctx.db.records.get_snapshot(sampler.id if inflight else sampler.snapshot_id)
        if snapshot is None or snapshot.status == "failed":
            user_error(f"sampler {sampler.id!r} has no weights: its save_weights_for_sampler failed")
    return WeightsRef(sampler.snapshot_id, sampler.model_id, sampler.checkpoint_dir, "sampler")


@router.post("/asample")
def asample(body: schemas.SampleRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    _check_unsupported(body)
    if body.sampling_session_id is None:
        sampler = _sessionless(ctx, body, owner)
    elif (found := ctx.db.records.get_sampling_session(body.sampling_session_id, owner)) is not None:
        sampler = found
    else:
        not_found(f"unknown sampling_session_id {body.sampling_session_id!r}")
    served, settings = ctx.models.get(owner, sampler.base_model), ctx.settings
    prompt = model_input_tokens(body.prompt, "prompt", served.limits.max_seq_len)
    # An unset max_tokens fills what the prompt leaves, short of the last position: the whole sequence then
    # fits a prompt again (compute_logprobs of a rollout, a next turn), which may hold max_seq_len tokens.
    room = max(served.info.max_seq_len - len(prompt), 1)
    request = SampleRequest(
        prompt=prompt,
        num_samples=body.num_samples,
        params=sampling_params(body.sampling_params, min(settings.default_max_tokens, room)),
        base_model=served.info.base_model,
        weights=_weights_of(ctx, sampler),
        prompt_logprobs=body.prompt_logprobs,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        model_dir=served.model_dir,
    )
    validate.check_sample(request, served.info, served.limits, settings.max_num_samples, settings.max_topk_logprobs)
    seq = body.seq_id
    tag = str(seq) if seq is not None else uuid.uuid4().hex[:12]  # deterministic when deduplicated by seq_id
    sequence_ids = [f"{sampler.id}:{tag}:{i}" for i in range(request.num_samples)]  # num_samples is bounded now
    return submit(
        ctx, kind="sample", payload=dataclasses.replace(request, sequence_ids=sequence_ids), owner=owner,
        model_id=sampler.id, seq_id=seq, dedupe_key=f"{sampler.id}#{seq}" if seq is not None else None,
        sequence_ids=sequence_ids,
    )  # fmt: skip


def _check_unsupported(body: schemas.SampleRequest) -> None:
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name) < 0:
            user_error(f"{name} must be >= 0, got {getattr(body, name)}")
    for name, is_set in _UNSUPPORTED.items():
        if is_set(body):
            user_error(f"{name} is not supported by this server")

"""Checkpoint endpoints that queue work: save_weights, save_weights_for_sampler, load_weights.

Saves name their checkpoint `tinker://{run}/weights/{name}` (adapter + optimizer) or
`.../sampler_weights/{name}` (weights only); an ephemeral sampler save (no name) creates the
sampling session `{session}:sample:{n}` directly. `load_weights` has two addressings: the legacy
one loads into an existing run (`model_id` + `seq_id`), the SDK 0.38 create-from-state one creates
run `{session_id}:train:{model_seq_id}` with the checkpoint's LoRA shape and loads into it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, HTTPException
from sqlmodel import SQLModel

from tx.api import schemas, validate
from tx.api.context import AppContext, Ctx, Owner, not_found, run_model, submit, usable_run, user_error
from tx.api.paths import TinkerPath, checkpoint_dir, parse_tinker_path
from tx.api.routes_train import check_live_session, new_run_row, submit_new_run
from tx.db.checkpoint_records import is_expired
from tx.db.tables import CheckpointRow, SamplerSnapshotRow, SamplingSessionRow, TrainingRunRow, utcnow
from tx.protocol import (
    DEFAULT_LORA_ALPHA,
    LoadStateRequest,
    LoadWeightsRequest,
    LoraConfig,
    SaveSamplerRequest,
    SaveStateRequest,
    inflight_snapshot_id,
    weights_shape,
)

router = APIRouter(prefix="/api/v1")


def _checkpoint_row(
    ctx: AppContext, path: TinkerPath, owner: str, ttl: int | None, meta: dict[str, str] | None
) -> CheckpointRow:
    validate.check_ttl(ttl)
    return CheckpointRow(
        run_id=path.run_id,
        checkpoint_id=path.checkpoint_id,
        checkpoint_type=path.checkpoint_type,
        tinker_path=str(path),
        owner=owner,
        directory=str(checkpoint_dir(ctx.settings.data_dir, path)),
        expires_at=utcnow() + timedelta(seconds=ttl) if ttl else None,
        user_metadata_json=json.dumps(meta or {}),
    )


@contextlib.contextmanager
def _claimed_name(
    ctx: AppContext, path: TinkerPath, owner: str, overwrite: bool, dedupe: str | None, fresh: bool
) -> Iterator[None]:
    """Free the checkpoint name for the save queued inside (not a retry's: `fresh` False), or refuse if it is
    taken and the caller did not ask to overwrite. A ready checkpoint under it is set aside, back in its
    place if the save fails, and at once if the save is never queued (a 503 from the database, say)."""
    existing = _claim_name(ctx, path, owner, overwrite, dedupe) if fresh else None
    try:
        yield
    except BaseException:
        if existing is not None:
            ctx.db.records.put_back(existing)
        raise


def _claim_name(
    ctx: AppContext, path: TinkerPath, owner: str, overwrite: bool, dedupe: str | None
) -> CheckpointRow | None:
    """The ready checkpoint set aside for the new save, if any."""
    validate.check_checkpoint_name(path.name)
    existing = ctx.db.records.get_checkpoint(path.run_id, path.checkpoint_id, owner, ready=False, expired=True)
    if existing is None:
        return None
    if not overwrite and not is_expired(existing):  # an expired one is gone to its owner: its name is free
        user_error(f"checkpoint {path.checkpoint_id!r} already exists for {path.run_id!r} (pass overwrite=True)")
    if existing.status == "ready":  # back in its place if the save over it fails
        ctx.db.records.set_aside(existing)
        return existing
    if not _ours(ctx, existing, dedupe):
        ctx.db.records.delete_checkpoint(existing)  # a save over this name still in flight: the newest wins
    return None


def _ours(ctx: AppContext, pending: CheckpointRow, dedupe: str | None) -> bool:
    """Whether `pending`'s save is this very request, queued by its first attempt after this retry looked
    for it (`fresh`): deleting its row lost the checkpoint the save then reported."""
    future = ctx.db.queue.get(pending.future_id) if pending.future_id is not None else None
    return dedupe is not None and future is not None and future.dedupe_key == dedupe


@router.post("/save_weights")
def save_weights(body: schemas.SaveWeightsRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    usable_run(ctx, body.model_id, owner)
    path = TinkerPath(body.model_id, "weights", body.path or f"seq-{body.seq_id or 0}")
    dedupe = f"{body.model_id}#{body.seq_id}" if body.seq_id else None
    fresh = dedupe is None or ctx.db.queue.get_by_key(dedupe) is None
    with _claimed_name(ctx, path, owner, body.overwrite, dedupe, fresh):
        row = _checkpoint_row(ctx, path, owner, body.ttl_seconds, body.user_metadata)
        payload = SaveStateRequest(path.name, row.directory, str(path))
        return submit(
            ctx, kind="save_state", payload=payload, owner=owner, model_id=body.model_id, seq_id=body.seq_id,
            dedupe_key=dedupe, rows=[row],
        )  # fmt: skip


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: schemas.SaveWeightsForSamplerRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    run = usable_run(ctx, body.model_id, owner)
    if run.lora_rank is not None and run_model(ctx, run).info.max_lora_adapters < 2:  # it would wait for good
        user_error(
            "save_weights_for_sampler: a LoRA run's sampler copy takes an adapter slot of its own, and this server "
            "has one (--max-lora-adapters 1); restart it with --max-lora-adapters 2 or more, or export the "
            "weights with save_weights_external"
        )
    dedupe = f"{body.model_id}#{body.seq_id}" if body.seq_id else None
    fresh = dedupe is None or ctx.db.queue.get_by_key(dedupe) is None
    rows: list[SQLModel]
    claim: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if body.path:
        path = TinkerPath(body.model_id, "sampler_weights", body.path)
        validate.check_checkpoint_name(path.name)  # the field named, before the name becomes a directory
        # a save under a taken name replaces the checkpoint and the snapshot it names
        claim = _claimed_name(ctx, path, owner, True, dedupe, fresh)
        ckpt = _checkpoint_row(ctx, path, owner, body.ttl_seconds, body.user_metadata)
        payload = SaveSamplerRequest(str(path), body.kind, path.name, ckpt.directory, str(path))
        rows = [
            ckpt,
            SamplerSnapshotRow(id=str(path), model_id=run.id, owner=owner, kind=body.kind, tinker_path=str(path)),
        ]
    elif body.sampling_session_seq_id is not None:
        sampler_id = f"{run.session_id}:sample:{body.sampling_session_seq_id}"
        # inflight: every such client of the run reads one shared snapshot, which each inflight save rewrites
        snapshot_id = inflight_snapshot_id(run.id) if body.kind == "inflight" else sampler_id
        payload = SaveSamplerRequest(snapshot_id, body.kind, session_id=sampler_id)
        rows = [] if not fresh else _ephemeral_rows(run, sampler_id, snapshot_id, owner, body.kind)
    else:
        user_error("save_weights_for_sampler needs a path (named checkpoint) or a sampling_session_seq_id")
    with claim:  # a named save's snapshot row replaces the one of that name in the queueing transaction
        return submit(
            ctx, kind="save_weights_for_sampler", payload=payload, owner=owner, model_id=body.model_id,
            seq_id=body.seq_id, dedupe_key=dedupe, rows=rows,
        )  # fmt: skip


@router.post("/save_weights_external")
def save_weights_external(body: schemas.SaveWeightsExternalRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    """Export the current weights as `tinker://{run}/external_weights/{name}`: a PEFT adapter (LoRA runs)
    or a Hugging Face model directory (full fine-tuning), the same files a named sampler save writes.
    Download them file by file through `external_weights_urls`."""
    usable_run(ctx, body.model_id, owner)
    if body.age_encryption_recipients:
        user_error("SmolGym cannot encrypt exports (age_encryption_recipients); omit it")
    path = TinkerPath(body.model_id, "external_weights", body.path)
    dedupe = f"{body.model_id}#{body.seq_id}" if body.seq_id else None
    fresh = dedupe is None or ctx.db.queue.get_by_key(dedupe) is None
    with _claimed_name(ctx, path, owner, True, dedupe, fresh):
        row = _checkpoint_row(ctx, path, owner, body.ttl_seconds, None)
        payload = SaveSamplerRequest(str(path), "snapshot", path.name, row.directory, str(path))
        return submit(
            ctx, kind="save_weights_external", payload=payload, owner=owner, model_id=body.model_id,
            seq_id=body.seq_id, dedupe_key=dedupe, rows=[row],
        )  # fmt: skip


def _ephemeral_rows(run: TrainingRunRow, sampler_id: str, snapshot_id: str, owner: str, kind: str) -> list[SQLModel]:
    """The sampling session, reading `snapshot_id`, and the row that follows its save (named by the session:
    for an inflight save the engine's snapshot is the run's shared one, which no row follows). A shared row
    linked to each save in turn had been marked failed by any one save's failure, refusing every inflight
    client of the run, and linked to the first alone it refused later clients once the first failed."""
    snapshot = SamplerSnapshotRow(id=sampler_id, model_id=run.id, owner=owner, kind=kind)
    sampler = SamplingSessionRow(
        id=sampler_id, session_id=run.session_id, owner=owner, base_model=run.base_model, model_id=run.id,
        snapshot_id=snapshot_id,
    )  # fmt: skip
    return [snapshot, sampler]


def resolve_checkpoint(ctx: AppContext, tinker_path: str, owner: str) -> tuple[TinkerPath, CheckpointRow]:
    path = parse_tinker_path(tinker_path)
    if path is None:
        user_error(
            f"{tinker_path!r} is not a checkpoint path (tinker://<run>/weights|sampler_weights|external_weights/<name>)"
        )
    row = ctx.db.records.get_checkpoint(path.run_id, path.checkpoint_id, owner, or_replaced=True)
    if row is None:
        not_found(f"unknown checkpoint {tinker_path!r}")
    return path, row


@router.post("/load_weights")
def load_weights(body: schemas.LoadWeightsRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    path, ckpt = resolve_checkpoint(ctx, body.path, owner)
    if path.kind != "weights":
        user_error(f"{body.path!r} holds weights only; load_weights needs a training checkpoint (…/weights/…)")
    if body.model_id is not None:
        _check_same_base(ctx, usable_run(ctx, body.model_id, owner), path, owner)
        payload = LoadStateRequest(ckpt.directory, str(path), body.optimizer)
        return submit(
            ctx, kind="load_state", payload=payload, owner=owner, model_id=body.model_id, seq_id=body.seq_id,
            dedupe_key=f"{body.model_id}#{body.seq_id}" if body.seq_id else None,
        )  # fmt: skip
    if body.session_id is None or body.model_seq_id is None:
        user_error("load_weights needs model_id, or session_id and model_seq_id (create from state)")
    return _create_from_state(ctx, body, owner, path, ckpt)


def _check_same_base(ctx: AppContext, run: TrainingRunRow, path: TinkerPath, owner: str) -> None:
    """A checkpoint loads into a run on the base model it was made on, never another one, and of its shape:
    the same kind (LoRA or full), rank and trained modules (the engine found a rank mismatch only once the
    request ran, and a module mismatch failed the restore as a damaged checkpoint, a server error)."""
    source = ctx.db.records.get_run(path.run_id, owner)
    if source is not None and not _same_model(ctx, source, run):
        user_error(
            f"checkpoint {str(path)!r} was made on base model {source.base_model!r}, but {run.id!r} runs on"
            f" {run.base_model!r}; create a training client from it instead (create_training_client_from_state)"
        )
    saved, target = (weights_shape(_run_lora(source)) if source is not None else None), weights_shape(_run_lora(run))
    if source is not None and saved != target:
        user_error(
            f"checkpoint {str(path)!r} holds a {_shape_text(saved)}, but {run.id!r} is a {_shape_text(target)};"
            " create a training client from it instead (create_training_client_from_state)"
        )


def _same_model(ctx: AppContext, a: TrainingRunRow, b: TrainingRunRow) -> bool:
    """Whether two runs train one base model: the same string, or two spellings of one directory (`dir` and
    `dir/`), which the pool loads once."""
    if a.base_model == b.base_model:
        return True
    try:
        return run_model(ctx, a).model_dir == run_model(ctx, b).model_dir
    except (HTTPException, validate.ValidationError):  # one cannot be served now (a deleted upload)
        return False


def _shape_text(shape: tuple[int, bool, bool, bool] | None) -> str:
    if shape is None:
        return "full fine-tuning run"
    rank, *flags = shape
    trained = [name for name, on in zip(("attn", "mlp", "unembed"), flags, strict=True) if on]
    return f"rank-{rank} LoRA run (train {', '.join(trained) or 'nothing'})"


def _create_from_state(
    ctx: AppContext, body: schemas.LoadWeightsRequest, owner: str, path: TinkerPath, ckpt: CheckpointRow
) -> dict[str, Any]:
    assert body.session_id is not None
    check_live_session(ctx, body.session_id, owner)  # a finished or expired session's run would never be reaped
    source = ctx.db.records.get_run(path.run_id, owner)
    if source is None:
        not_found(f"the training run of {body.path!r} no longer exists")
    made_on = run_model(ctx, source)
    served, base_model = made_on, source.base_model
    if body.base_model is not None and body.base_model != base_model:  # an override: the same model, other limits
        served, base_model = ctx.models.get(owner, body.base_model), body.base_model
        if served.model_dir != made_on.model_dir:
            user_error(f"checkpoint {body.path!r} was made on base model {source.base_model!r}, not {base_model!r}")
    lora = _run_lora(source)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    meta = body.user_metadata or {}
    run = new_run_row(model_id, body.session_id, owner, base_model, lora, meta)
    payload = LoadWeightsRequest(
        served.info.base_model, lora, ckpt.directory, str(path), body.optimizer, meta, served.model_dir
    )
    return submit_new_run(ctx, run, "load_weights", payload)


def _run_lora(run: TrainingRunRow) -> LoraConfig | None:
    if run.lora_rank is None:
        return None
    alpha = run.lora_alpha if run.lora_alpha is not None else DEFAULT_LORA_ALPHA
    return LoraConfig(run.lora_rank, alpha, run.train_attn, run.train_mlp, run.train_unembed)


@router.post("/weights_info")
def weights_info(body: schemas.WeightsInfoRequest, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    path, _ = resolve_checkpoint(ctx, body.tinker_path, owner)
    run = ctx.db.records.get_run(path.run_id, owner)
    if run is None:
        not_found(f"the training run of {body.tinker_path!r} no longer exists")
    return {
        "base_model": run.base_model,
        "is_lora": run.lora_rank is not None,
        "lora_rank": run.lora_rank,
        "train_attn": run.train_attn,
        "train_mlp": run.train_mlp,
        "train_unembed": run.train_unembed,
        "optimizer_config": {"type": "adamw"},
    }

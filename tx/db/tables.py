"""SQLModel tables: sessions, training runs, sampling sessions, sampler snapshots, checkpoints,
futures (the work queue) and per-step metrics.

Rows that a queued request brings into existence (a run for `create_model`, a checkpoint for a
save, a sampler snapshot) are inserted together with the request, in status `pending`, carrying the
request's `future_id`; the engine's completion flips them to `ready` (or `failed`) in the same
transaction that stores the result. Owners are stored as a hash of the caller's API key, and every
lookup on behalf of a caller filters by it. Times are UTC; `created_at` of futures is epoch seconds
because the engine measures latency with it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import BigInteger, Column, Index, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


# An `open` session stands in for a client older than sessions (tinker SDK 0.1-0.2): it was made by a
# create_model without a session_id and gets no heartbeats; it expires once none of its runs finished a
# request for the open timeout (`Records.expire_sessions`); finishing it ends it.
LIVE_SESSION = ("active", "open")
# A checkpoint row set aside while a save over its name runs (status, and a suffix to its checkpoint_id
# that keeps the name free): the save's success drops it, its failure puts it back (`tx.db.queue`).
REPLACED, REPLACED_MARK = "replaced", "#replaced-"


class SessionRow(SQLModel, table=True):
    __tablename__ = "sessions"

    id: str = Field(primary_key=True)
    owner: str = Field(index=True)
    status: str = "active"  # active | finished | expired | open (LIVE_SESSION: accepts work)
    finish_reason: str | None = None
    sdk_version: str | None = None
    tags_json: str = "[]"
    user_metadata_json: str = "{}"
    created_at: datetime = Field(default_factory=utcnow)
    last_heartbeat_at: datetime = Field(default_factory=utcnow)


class TrainingRunRow(SQLModel, table=True):
    __tablename__ = "training_runs"

    id: str = Field(primary_key=True)  # "{session_id}:train:{model_seq_id}"
    session_id: str = Field(index=True)
    owner: str = Field(index=True)
    base_model: str
    lora_rank: int | None = None  # None = full fine-tuning
    lora_alpha: float | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    status: str = "pending"  # pending | ready | failed | unloaded
    future_id: str | None = None
    user_metadata_json: str = "{}"
    created_at: datetime = Field(default_factory=utcnow)
    last_request_at: datetime = Field(default_factory=utcnow)


class SamplerSnapshotRow(SQLModel, table=True):
    __tablename__ = "sampler_snapshots"

    id: str = Field(primary_key=True)  # snapshot id the engine knows the weights by
    model_id: str = Field(index=True)
    owner: str
    kind: str = "snapshot"  # snapshot | inflight
    tinker_path: str | None = None
    status: str = "pending"
    future_id: str | None = None
    created_at: datetime = Field(default_factory=utcnow)


class SamplingSessionRow(SQLModel, table=True):
    __tablename__ = "sampling_sessions"

    id: str = Field(primary_key=True)  # "{session_id}:sample:{seq}"
    session_id: str = Field(index=True)
    owner: str = Field(index=True)
    base_model: str
    model_path: str | None = None
    model_id: str | None = None
    snapshot_id: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_type: str = "sampler"
    created_at: datetime = Field(default_factory=utcnow)


class CheckpointRow(SQLModel, table=True):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "checkpoint_id"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    checkpoint_id: str  # "weights/<name>" | "sampler_weights/<name>"
    checkpoint_type: str  # training | sampler
    tinker_path: str = Field(index=True)
    owner: str = Field(index=True)
    directory: str
    status: str = "pending"
    future_id: str | None = None
    size_bytes: int | None = Field(default=None, sa_type=BigInteger)  # a full fine-tuning state passes 2 GiB
    public: bool = False
    expires_at: datetime | None = None
    user_metadata_json: str = "{}"
    created_at: datetime = Field(default_factory=utcnow)


class FutureRow(SQLModel, table=True):
    __tablename__ = "futures"
    # (status, owner, id) covers the claim's turns: without it SQLite read every live request's payload
    __table_args__ = (
        Index("ix_futures_status_id", "status", "id"),
        Index("ix_futures_live", "status", "owner", "id"),
        Index("ix_futures_done", "status", "completed_at"),  # the results past their retention
    )

    id: int | None = Field(default=None, primary_key=True)
    kind: str
    model_id: str | None = Field(default=None, index=True)
    seq_id: int | None = Field(default=None, sa_type=BigInteger)  # any int64 the API admits
    dedupe_key: str | None = Field(default=None, unique=True)
    payload_hash: str = ""
    payload: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    owner: str = ""
    status: str = "pending"  # pending | running | done | failed
    result: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    error: str | None = None
    error_category: str | None = None
    sequence_ids_json: str | None = None
    created_at: float = 0.0
    completed_at: float | None = None


class MetricRow(SQLModel, table=True):
    __tablename__ = "metrics"

    id: int | None = Field(default=None, primary_key=True)
    model_id: str = Field(index=True)
    future_id: str
    kind: str
    name: str
    value: float | None  # None stands for NaN (SQLite stores NaN as NULL); +-inf are stored as they are
    created_at: datetime = Field(default_factory=utcnow)

"""The rows a request brings into existence (training runs, checkpoints, sampler snapshots, each linked to its
future by `future_id`) and how they follow their request: ready when it finishes, failed (a failed save's
checkpoint row deleted, the row it set aside put back) when it fails, and what a new engine finds of them
after a restart (`SqlQueue.recover`, `SqlQueue.settle_saved`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Table, and_
from sqlmodel import Session, SQLModel, col, select

from tx.db.tables import REPLACED, REPLACED_MARK, CheckpointRow, SamplerSnapshotRow, TrainingRunRow
from tx.protocol import CheckpointResult, inflight_snapshot_id


def table_of(model: type[SQLModel]) -> Table:
    return model.__table__  # type: ignore[attr-defined]


RUNS, CHECKPOINTS = table_of(TrainingRunRow), table_of(CheckpointRow)
LINKED = (RUNS, CHECKPOINTS, table_of(SamplerSnapshotRow))


def mark_linked(session: Session, future_ids: Sequence[str], status: str) -> None:
    """The rows the futures brought into existence (runs, checkpoints, sampler snapshots) become `status`."""
    for start in range(0, len(future_ids), 500):  # bound the statement's parameters (recovery may fail many)
        ids = future_ids[start : start + 500]
        saved = select(CHECKPOINTS.c.tinker_path).where(CHECKPOINTS.c.future_id.in_(ids))
        paths = list(session.execute(saved).scalars())
        for table in LINKED:
            session.execute(table.update().where(table.c.future_id.in_(ids)).values(status=status))
        if status == "failed":  # a failed save leaves no checkpoint behind, so the name stays free
            session.execute(CHECKPOINTS.delete().where(CHECKPOINTS.c.future_id.in_(ids)))
        settle_replaced(session, paths, status)


def settle_replaced(session: Session, paths: Sequence[str], status: str) -> None:
    """A save over a taken name set the old checkpoint's row aside (`Records.set_aside`): a save that succeeds
    drops it; one that fails puts it back, as its files were never touched (writers replace a directory
    whole, at the end)."""
    if not paths:
        return
    aside = and_(CHECKPOINTS.c.status == REPLACED, CHECKPOINTS.c.tinker_path.in_(paths))
    if status != "failed":
        session.execute(CHECKPOINTS.delete().where(aside))
        return
    for row_id, checkpoint_id in session.execute(
        select(CHECKPOINTS.c.id, CHECKPOINTS.c.checkpoint_id).where(aside)
    ).all():
        original = checkpoint_id.split(REPLACED_MARK)[0]
        session.execute(
            CHECKPOINTS.update().where(CHECKPOINTS.c.id == row_id).values(status="ready", checkpoint_id=original)
        )


def put_back_orphans(session: Session) -> None:
    """Checkpoints set aside for a save that was never queued (the API process died, or the database refused
    the queueing, in between): no save will settle them, so they go back to their names."""
    replacing = select(CHECKPOINTS.c.tinker_path).where(CHECKPOINTS.c.status != REPLACED)
    orphans = and_(CHECKPOINTS.c.status == REPLACED, CHECKPOINTS.c.tinker_path.not_in(replacing))
    for row_id, checkpoint_id in session.execute(select(CHECKPOINTS.c.id, CHECKPOINTS.c.checkpoint_id).where(orphans)):
        original = checkpoint_id.split(REPLACED_MARK)[0]
        session.execute(
            CHECKPOINTS.update().where(CHECKPOINTS.c.id == row_id).values(status="ready", checkpoint_id=original)
        )


def saved_result(kind: str, tinker_path: str) -> CheckpointResult:
    """What a named save answers (a named sampler save's snapshot is its path: `routes_weights`)."""
    return CheckpointResult(tinker_path, tinker_path if kind == "save_weights_for_sampler" else None)


def lost_runs(session: Session) -> dict[str, str | None]:
    """Every ready run -> the tinker path of its newest ready training checkpoint (or None)."""
    runs = session.exec(select(TrainingRunRow.id).where(TrainingRunRow.status == "ready")).all()
    saved = session.exec(
        select(CheckpointRow.run_id, CheckpointRow.tinker_path)
        .where(CheckpointRow.status == "ready", CheckpointRow.checkpoint_type == "training")
        .order_by(col(CheckpointRow.created_at), col(CheckpointRow.id))
    ).all()
    newest = dict(saved)  # later rows overwrite earlier ones
    return {run: newest.get(run) for run in runs}


def lost_snapshots(session: Session) -> frozenset[str]:
    """Ready sampler snapshots with no checkpoint on disk (ephemeral saves): they lived in memory only. An
    inflight save's row is its client's; the engine's snapshot it wrote is the run's shared one, lost too."""
    query = select(SamplerSnapshotRow.id, SamplerSnapshotRow.model_id, SamplerSnapshotRow.kind).where(
        SamplerSnapshotRow.status == "ready", col(SamplerSnapshotRow.tinker_path).is_(None)
    )
    rows = session.exec(query).all()
    shared = [inflight_snapshot_id(model_id) for _, model_id, kind in rows if kind == "inflight"]
    return frozenset([row_id for row_id, _, _ in rows] + shared)

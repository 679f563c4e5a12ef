"""The order work is claimed in: each owner's n-th unfinished request takes turn n, turns go in order, and a
claim stops at the owner share and the byte budget (`SqlQueue.claim`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func
from sqlmodel import col, select

from tx.db.tables import FutureRow


def within(turns: Sequence[Any], per_owner: int | None, max_bytes: int | None) -> tuple[list[int], set[str], bool]:
    """Of (id, turn, bytes, owner) rows in turn order: the ids within the owner share and the bytes, the owners
    left at their share, and whether the bytes cut the claim short. A finish of one of those owners' requests
    (or any, after a cut) is worth another look; others are not (each look ranks every queued request)."""
    ids: list[int] = []
    left: set[str] = set()
    total = 0
    for row_id, turn, nbytes, owner in turns:
        if per_owner is not None and turn > per_owner:
            left.add(owner)
            continue
        if max_bytes is not None and ids and total + (nbytes or 0) > max_bytes:
            return ids, left, True
        ids.append(row_id)
        total += nbytes or 0
    return ids, left, False


def turns(limit: int) -> Any:
    """The ids, turns and stored sizes of the `limit` pending requests whose turn comes first: an owner's n-th
    unfinished request (running ones count) takes turn n, and turns go in order, ids within a turn. Claimed in
    id order, one tenant's backlog (100k queued samples, say) held every later request of every tenant behind
    it for as long as it took to run; now each owner's next request comes before anyone's backlog."""
    turn = func.row_number().over(partition_by=col(FutureRow.owner), order_by=col(FutureRow.id)).label("turn")
    live = col(FutureRow.status).in_(("pending", "running"))
    unfinished = select(FutureRow.id, FutureRow.status, turn).where(live).subquery()
    pending = unfinished.c.status == "pending"
    first = select(unfinished.c.id, unfinished.c.turn).where(pending).order_by(unfinished.c.turn, unfinished.c.id)
    chosen = first.limit(limit).subquery()
    size = func.length(FutureRow.payload)  # of those rows alone: the stored header says, the blob is not read
    by_turn = (chosen.c.turn, chosen.c.id)
    joined = col(FutureRow.id) == chosen.c.id
    return select(chosen.c.id, chosen.c.turn, size, FutureRow.owner).join(FutureRow, joined).order_by(*by_turn)

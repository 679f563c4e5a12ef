"""After a restart: which queued requests needed state the dead engine process held, decided by kind.

The queue (`tx.db.queue.SqlQueue.recover`) settles row status: claimed work failed, pending work kept,
ready runs unloaded, and reports what was lost (`LostState`). The rule for the pending work lives here,
where request kinds are known. A request on a run that lived in the dead process (forward, forward_backward,
optim_step, save_state, save_weights_for_sampler, load_state into it) fails naming the run and its last
training checkpoint; an unload of such a run succeeds (nothing is left to free); a sample of a snapshot that
lived only in memory fails. Everything else runs as it would have: creating runs (`create_model`,
`load_weights` from a checkpoint), sampling the base model or a sampler checkpoint on disk, and any request
on a run created by queued work. `RestartGate` applies the rule in front of the runner, so no process of a
several-process engine ever sees those requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from tx.engine.loop import Completion, Runner
from tx.protocol import LostState, RequestError, SampleRequest, UnloadResult, WorkItem


def lost_run_message(run_id: str, checkpoint: str | None) -> str:
    said = f"model {run_id!r} lost its in-memory state (weights, gradients, optimizer state) when the server restarted"
    if checkpoint is None:
        return f"{said}; it saved no training checkpoint (save_state), so create a new run to start again"
    return (
        f"{said}; restore it with load_state from its last checkpoint {checkpoint} "
        "(ServiceClient.create_training_client_from_state)"
    )


def settle(item: WorkItem, lost: LostState) -> Completion | None:
    """The outcome of a request that needed lost state, or None when it can run."""
    if item.kind == "sample":
        weights = item.payload.weights if isinstance(item.payload, SampleRequest) else None
        if weights is None or weights.checkpoint_dir or weights.snapshot_id not in lost.snapshots:
            return None
        message = (
            f"sampler weights {weights.snapshot_id!r} lived in memory only and were lost when the server restarted;"
            " save them with a name to keep them"
        )
        return Completion(item.future_id, RequestError(message, "user"))
    if item.model_id not in lost.runs:  # a run created by queued work, or no run at all
        return None
    if item.kind == "unload_model":
        return Completion(item.future_id, UnloadResult(str(item.model_id)))
    message = lost_run_message(str(item.model_id), lost.runs[str(item.model_id)])
    return Completion(item.future_id, RequestError(message, "user"))


class RestartGate:
    """A `Runner` in front of another: requests that needed lost state finish here, the rest go on."""

    def __init__(self, runner: Runner, lost: LostState) -> None:
        self.runner, self.lost = runner, lost
        self.outbox: list[Completion] = []

    def submit(self, items: Sequence[WorkItem]) -> None:
        runnable = []
        for item in items:
            settled = settle(item, self.lost)
            self.outbox.append(settled) if settled is not None else runnable.append(item)
        if runnable:
            self.runner.submit(runnable)

    def step(self) -> list[Completion]:
        """The settled requests and the runner's step; the runner first, so a step that raises leaves the
        settled ones for the next (taken first, they were lost with the step's failure)."""
        stepped = self.runner.step() if not self.runner.idle() else []
        done, self.outbox = [*self.outbox, *stepped], []
        return done

    def idle(self) -> bool:
        return not self.outbox and self.runner.idle()

    def parked(self) -> int:
        """The inner runner's requests waiting for a model load (`Engine._parked`)."""
        return int(getattr(self.runner, "parked", lambda: 0)())

    def discard(self, future_ids: Sequence[str]) -> None:
        gone = set(future_ids)
        self.outbox = [c for c in self.outbox if c.future_id not in gone]
        getattr(self.runner, "discard", lambda _: None)(future_ids)

    def close(self) -> None:
        getattr(self.runner, "close", lambda: None)()

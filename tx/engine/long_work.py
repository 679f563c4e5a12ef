"""A forward/forward_backward request larger than one planning round, run one micro-batch per round.

The planner hands such a request over as the round's long item (`tx.engine.planner`); it runs through
`Trainer.forward_backward_steps`, which pauses after each micro-batch, so every round also runs the other
tenants' small requests and a large request delays them by at most one micro-batch. Its run takes no other
item and stays on the device (the runner protects it from paging) until the request completes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator

from tx.engine.loop import Completion
from tx.engine.trainer import Trainer
from tx.protocol import ForwardBackwardRequest, ForwardBackwardResult, RequestError, WorkItem

log = logging.getLogger("tx.engine")
Steps = Generator[None, None, list[ForwardBackwardResult]]


class LongItem:
    """At most one long request in progress; `advance()` runs its next micro-batch."""

    def __init__(self, trainer: Trainer, as_error: Callable[[BaseException], RequestError]) -> None:
        self.trainer, self.as_error = trainer, as_error
        self.item: WorkItem | None = None
        self._steps: Steps | None = None

    def runs(self) -> frozenset[str]:
        return frozenset() if self.item is None else frozenset({str(self.item.model_id)})

    def start(self, item: WorkItem) -> None:
        assert self.item is None and isinstance(item.payload, ForwardBackwardRequest)
        self.item = item
        self._steps = self.trainer.forward_backward_steps([(str(item.model_id), item.payload)])

    def advance(self) -> list[Completion]:
        """One micro-batch; the request's completion once its last one has run (or it failed)."""
        if self.item is None or self._steps is None:
            return []
        item = self.item
        try:
            next(self._steps)
            return []
        except StopIteration as finished:
            result: ForwardBackwardResult | RequestError = finished.value[0]
        except Exception as err:  # contained: this request fails (its gradients were undone), nothing else
            log.warning("forward_backward %s failed: %s", item.future_id, err, exc_info=True)
            result = self.as_error(err)
        self.item, self._steps = None, None
        return [Completion(item.future_id, result)]

    def discard(self, future_ids: set[str]) -> None:
        if self.item is not None and self.item.future_id in future_ids:
            assert self._steps is not None
            self._steps.close()  # dropped: what its finished micro-batches added is undone (`_undo_on_error`)
            self.item, self._steps = None, None

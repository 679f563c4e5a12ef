"""The pure planner: which queued training-side items run in this round.

Runs take turns (round-robin: every run's first item, then every run's second, ...), in the order of their
turn keys (`RoundLimits.turns`: the runner gives the run served least recently the lowest, so a run the
budget left out of one round leads the next and a tenant with a deep queue cannot hold another's request
back round after round), and each run's items stay in arrival order:
a run whose next item cannot join the round contributes nothing more to it. A run adds its leading
forward/forward_backward items to one fused batch, then at most one control item (optim_step, save, load,
create, unload). The fused batch takes at most `RoundLimits.tokens` tokens, so a
tenant's large request cannot fill a round ahead of another's small one; a request larger than that on its
own is a *long* item, run one micro-batch per round beside the others (one at a time). A round holds at most
`max_slots` adapter slots: one per LoRA run, one more for a snapshot it saves; an item that needs more than
`max_slots` even alone is named in `Plan.starved` (the runner then lets sampling's slots drain). Full
fine-tuning runs are never fused with others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tx.protocol import ForwardBackwardRequest, WorkItem

BATCHED = ("forward", "forward_backward")


@dataclasses.dataclass(frozen=True)
class RoundLimits:
    max_slots: int | None = None  # adapter slots the round may hold (the device slots the sampler leaves)
    tokens: int | None = None  # tokens of the fused batch; a larger single request runs as the long item
    busy: frozenset[str] = frozenset()  # runs with a long item in progress: none of their items now
    turns: Mapping[str, int] = dataclasses.field(default_factory=dict)  # run -> its turn key: lower goes first


@dataclasses.dataclass
class Plan:
    fused: list[WorkItem] = dataclasses.field(default_factory=list)
    control: list[WorkItem] = dataclasses.field(default_factory=list)
    long: WorkItem | None = None  # a request over the token budget, to start now
    starved: int = 0  # the most slots an item left out needs alone, past `max_slots` (0: none such)

    @property
    def items(self) -> list[WorkItem]:
        return [*self.fused, *self.control, *([self.long] if self.long else [])]


def item_tokens(item: WorkItem) -> int:
    """Tokens a forward/forward_backward item puts through the model (0 for control items)."""
    payload = item.payload
    return sum(len(d.tokens) for d in payload.data) if isinstance(payload, ForwardBackwardRequest) else 0


class _Round:
    def __init__(self, full_runs: set[str], limits: RoundLimits) -> None:
        self.plan, self.full_runs, self.limits = Plan(), full_runs, limits
        self.blocked: set[str] = set(limits.busy)
        self.taking: set[str] = {r for r in limits.busy if r not in full_runs}
        self.tokens = 0
        self.full_in_batch: str | None = None

    def offer(self, item: WorkItem) -> None:
        """Take `item` into the plan, or block its run for the rest of the round."""
        run = str(item.model_id)
        if run in self.blocked:
            return
        if not self._fits_slots(run, item):
            self.blocked.add(run)
            self._note_starved(run, item)
            return
        self.taking.add(run)
        if item.kind in BATCHED:
            self._offer_batched(run, item)
            return
        self.blocked.add(run)
        self.plan.control.append(item)

    def _fits_slots(self, run: str, item: WorkItem) -> bool:
        need = self._need(run, item) - int(run in self.taking and run not in self.full_runs)  # its run's is held
        held = sum(r not in self.full_runs for r in self.taking)
        return self.limits.max_slots is None or held + need <= self.limits.max_slots

    def _need(self, run: str, item: WorkItem) -> int:
        """Slots the item holds alone: its LoRA run's, and one more for a snapshot it saves."""
        lora = run not in self.full_runs
        return int(lora) + int(lora and item.kind == "save_weights_for_sampler")

    def _note_starved(self, run: str, item: WorkItem) -> None:
        need = self._need(run, item)
        if self.limits.max_slots is not None and need > self.limits.max_slots:
            self.plan.starved = max(self.plan.starved, need)

    def _offer_batched(self, run: str, item: WorkItem) -> None:
        tokens, budget = item_tokens(item), self.limits.tokens
        if budget is not None and tokens > budget:  # the long item: alone, a micro-batch per round
            self.blocked.add(run)
            if self.plan.long is None and not self.limits.busy:
                self.plan.long = item
            return
        full = run in self.full_runs
        mixes = self.full_in_batch not in (None, run) or (full and self.full_in_batch is None and self.plan.fused)
        if mixes or (budget is not None and self.tokens + tokens > budget):
            self.blocked.add(run)
            return
        self.full_in_batch = run if full else self.full_in_batch
        self.tokens += tokens
        self.plan.fused.append(item)


def plan_round(pending: Sequence[WorkItem], full_runs: set[str], limits: RoundLimits = RoundLimits()) -> Plan:
    """The items that run in this round (see the module docstring), each run's in arrival order."""
    queues: dict[str, list[WorkItem]] = {}
    for item in pending:
        queues.setdefault(str(item.model_id), []).append(item)
    turns = sorted(queues, key=lambda run: limits.turns.get(run, -1))  # stable: ties keep arrival order
    round_ = _Round(full_runs, limits)
    depth = max((len(q) for q in queues.values()), default=0)
    for k in range(depth):
        for queue in (queues[run] for run in turns):
            if k < len(queue):
                round_.offer(queue[k])
    return round_.plan

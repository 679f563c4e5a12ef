"""The pure planner: runs take turns, each run's items in order, within a round's token and slot bounds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tx.engine.planner import RoundLimits, item_tokens, plan_round
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, OptimStepRequest, WorkItem

_ids = iter(range(10**6))


def _fb(run: str, tokens: int) -> WorkItem:
    datum = Datum(list(range(tokens)), {})
    return WorkItem(f"f{next(_ids)}", "forward_backward", run, ForwardBackwardRequest([datum], "cross_entropy"), 0.0)


def _optim(run: str) -> WorkItem:
    return WorkItem(f"f{next(_ids)}", "optim_step", run, OptimStepRequest(AdamParams(1e-3)), 0.0)


def _ids_of(items: list[Any]) -> list[str]:
    return [i.future_id for i in items]


def test_runs_take_turns_within_the_token_budget_and_keep_their_order() -> None:
    a = [_fb("a", 10), _fb("a", 10), _fb("a", 10)]
    b = [_fb("b", 10), _optim("b")]
    plan = plan_round([*a, *b], set(), RoundLimits(tokens=25))
    assert _ids_of(plan.fused) == _ids_of([a[0], b[0]])  # a's second item would pass 25 tokens: a waits
    assert _ids_of(plan.control) == _ids_of([b[1]]) and plan.long is None
    assert item_tokens(a[0]) == 10 and item_tokens(b[1]) == 0
    everything = plan_round([*a, *b], set())
    assert _ids_of(everything.fused) == _ids_of([a[0], b[0], a[1], a[2]])


def test_a_request_over_the_budget_is_the_long_item_and_its_run_takes_nothing_else() -> None:
    big, after, other = _fb("a", 100), _fb("a", 5), _fb("b", 5)
    plan = plan_round([big, after, other], set(), RoundLimits(tokens=20))
    assert plan.long is big and _ids_of(plan.fused) == _ids_of([other])
    busy = plan_round([big, after, other], set(), RoundLimits(tokens=20, busy=frozenset({"a"})))
    assert busy.long is None and _ids_of(busy.fused) == _ids_of([other])


def test_slots_bound_the_runs_of_a_round() -> None:
    items = [_fb("a", 5), _fb("b", 5), _fb("c", 5)]
    assert _ids_of(plan_round(items, set(), RoundLimits(max_slots=2)).fused) == _ids_of(items[:2])
    assert _ids_of(plan_round(items, {"c"}, RoundLimits(max_slots=2)).fused) == _ids_of(items[:2])


def test_budget_and_slot_boundaries_are_inclusive() -> None:
    exact = [_fb("a", 10), _fb("b", 10)]
    plan = plan_round(exact, set(), RoundLimits(tokens=20))  # exactly the budget: both fuse, no long item
    assert _ids_of(plan.fused) == _ids_of(exact) and plan.long is None
    assert plan_round([_fb("a", 20)], set(), RoundLimits(tokens=20)).long is None
    assert plan_round([], set(), RoundLimits(tokens=20)).items == []


def test_a_snapshot_save_needs_a_second_slot_and_a_long_runs_slot_is_held() -> None:
    save = WorkItem("s1", "save_weights_for_sampler", "a", None, 0.0)  # type: ignore[arg-type]
    assert plan_round([save], set(), RoundLimits(max_slots=1)).control == []
    assert _ids_of(plan_round([save], set(), RoundLimits(max_slots=2)).control) == ["s1"]
    other = _fb("b", 5)
    held = plan_round([other], set(), RoundLimits(max_slots=1, busy=frozenset({"a"})))
    assert held.fused == []  # the long item's run "a" holds the only slot
    full_busy = plan_round([other], {"a"}, RoundLimits(max_slots=1, busy=frozenset({"a"})))
    assert _ids_of(full_busy.fused) == _ids_of([other])  # a full fine-tuning run holds no adapter slot


def test_an_item_that_needs_more_slots_than_sampling_leaves_even_alone_is_starved() -> None:
    """`starved` names the slots an item left out needs alone: a save past one free slot, a LoRA step past
    none. An item that only waits behind other runs of the round is not starved, nor a full run's."""
    save = WorkItem("s1", "save_weights_for_sampler", "a", None, 0.0)  # type: ignore[arg-type]
    assert plan_round([save], set(), RoundLimits(max_slots=1)).starved == 2
    assert plan_round([save], set(), RoundLimits(max_slots=2)).starved == 0
    assert plan_round([_fb("a", 5), save], set(), RoundLimits(max_slots=0)).starved == 1
    behind = plan_round([_fb("a", 5), _fb("b", 5)], set(), RoundLimits(max_slots=1))
    assert behind.starved == 0 and len(behind.fused) == 1  # b waits its turn
    assert plan_round([_fb("a", 5), save], set(), RoundLimits(max_slots=1)).starved == 2  # behind a's step
    assert plan_round([_optim("f")], {"f"}, RoundLimits(max_slots=0)).starved == 0
    assert plan_round([save], set()).starved == 0


def test_a_full_finetuning_run_never_shares_the_fused_batch() -> None:
    lora_first = [_fb("a", 5), _fb("full", 5)]
    assert _ids_of(plan_round(lora_first, {"full"}).fused) == _ids_of(lora_first[:1])
    full_first = [_fb("full", 5), _fb("full", 5), _fb("a", 5)]
    assert _ids_of(plan_round(full_first, {"full"}).fused) == _ids_of(full_first[:2])


def test_a_runs_later_items_and_a_full_runs_items_take_no_new_slot() -> None:
    a1, a2, full = _fb("a", 5), _fb("a", 5), _optim("f")
    plan = plan_round([a1, full, a2], {"f"}, RoundLimits(max_slots=1))
    assert _ids_of(plan.fused) == _ids_of([a1, a2]) and _ids_of(plan.control) == _ids_of([full])


def test_one_long_item_at_a_time_the_first_in_turn() -> None:
    first, second = _fb("a", 100), _fb("b", 100)
    assert plan_round([first, second], set(), RoundLimits(tokens=20)).long is first
    in_progress = RoundLimits(tokens=20, busy=frozenset({"x"}))  # run x's long item: no other starts
    assert plan_round([second], set(), in_progress).long is None


def test_the_default_limits_shared_by_every_call_cannot_be_changed() -> None:
    """plan_round's default RoundLimits is one instance shared by every call: a caller that could set a field on
    it would change the limits of every later round planned without explicit ones."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        RoundLimits().tokens = 5  # type: ignore[misc]


def test_the_run_served_least_recently_leads_the_next_round() -> None:
    """A tenant with a deep queue of near-budget requests cannot hold another's small request back: the run
    the budget left out of a round leads the next one. Rounds are replayed as the runner plays them."""
    a = [_fb("a", 15) for _ in range(5)]
    b = _fb("b", 10)
    pending, served, rounds_of_b = [*a, b], {}, None
    for round_ in range(1, 10):
        plan = plan_round(pending, set(), RoundLimits(tokens=20, turns=dict(served)))
        served.update({str(i.model_id): round_ for i in plan.items})
        if b in plan.items:
            rounds_of_b = round_
        pending = [i for i in pending if i not in plan.items]
    assert rounds_of_b == 2 and not pending  # round 1: a's first request alone (b would pass the budget)
    assert _ids_of(plan_round([*a, b], set(), RoundLimits(tokens=20, turns={"a": 3})).fused) == _ids_of([b])
    assert _ids_of(plan_round([*a, b], set(), RoundLimits(tokens=20, turns={"b": 3})).fused) == _ids_of(a[:1])


def test_a_run_in_host_memory_takes_its_turn_after_the_device_runs_within_a_bound() -> None:
    """Round-robin over more runs than slots would page a run in and out every turn: a paged-out run's turn
    key is later by PAGE_PATIENCE rounds, so device runs go first until it has waited that much longer."""
    from tx.engine.planner import Plan
    from tx.engine.round_notes import PAGE_PATIENCE, RoundNotes

    notes = RoundNotes()
    notes.planned(Plan(fused=[_fb("away", 5)]), {"away", "here"})  # round 1
    for _ in range(PAGE_PATIENCE):
        notes.planned(Plan(fused=[_fb("here", 5)]), {"away", "here"})
    turns = notes.turns(in_host_memory={"away"})
    assert turns == {"away": 1 + PAGE_PATIENCE, "here": 1 + PAGE_PATIENCE}  # a tie: arrival order decides
    notes.planned(Plan(fused=[_fb("here", 5)]), {"away", "here"})
    assert notes.turns({"away"})["away"] < notes.turns({"away"})["here"]  # now it goes first
    assert (
        notes.turns(set())["away"] == 1
        and notes.turns(
            {"away"},
        )["away"]
        == 1 + PAGE_PATIENCE
    )
    notes.planned(Plan(), {"here"})  # an unloaded run is forgotten
    assert set(notes.turns(set())) == {"here"}

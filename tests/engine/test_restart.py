"""The restart rule: which requests queued before a restart needed the dead process's memory."""

from __future__ import annotations

from tx.engine.restart import RestartGate, settle
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    LoraConfig,
    LostState,
    OptimStepRequest,
    RequestError,
    SampleRequest,
    SamplingParams,
    UnloadModelRequest,
    UnloadResult,
    WeightsRef,
    WorkItem,
)

LOST = LostState({"a:train:0": "tinker://a:train:0/weights/kept", "b:train:0": None}, frozenset({"a:sample:0"}))


def item(future_id: str, kind: str, model_id: str | None, payload) -> WorkItem:  # noqa: ANN001
    return WorkItem(future_id, kind, model_id, payload, 0.0)  # type: ignore[arg-type]


def sample(future_id: str, weights: WeightsRef | None) -> WorkItem:
    return item(future_id, "sample", "s:sample:1", SampleRequest([1, 2], 1, SamplingParams(3), "m", weights))


def test_only_requests_on_lost_state_are_settled_and_each_says_what_was_lost() -> None:
    step = OptimStepRequest(AdamParams())
    outcomes = {
        i.future_id: settle(i, LOST)
        for i in [
            item("1", "optim_step", "a:train:0", step),
            item("2", "optim_step", "b:train:0", step),
            item("3", "unload_model", "a:train:0", UnloadModelRequest()),
            item("4", "optim_step", "c:train:0", step),  # created by queued work
            item("5", "create_model", "d:train:0", CreateModelRequest("m", LoraConfig(4))),
            sample("6", WeightsRef("a:sample:0", "a:train:0")),
            sample("7", WeightsRef("named", "a:train:0", checkpoint_dir="/data/named")),
            sample("8", None),
        ]
    }
    errors = {f: c.result for f, c in outcomes.items() if c is not None and isinstance(c.result, RequestError)}
    assert sorted(errors) == ["1", "2", "6"] and {e.category for e in errors.values()} == {"user"}
    assert "'a:train:0' lost its in-memory state" in errors["1"].message
    assert "load_state from its last checkpoint tinker://a:train:0/weights/kept" in errors["1"].message
    assert "saved no training checkpoint" in errors["2"].message
    assert "'a:sample:0' lived in memory only" in errors["6"].message
    assert outcomes["3"] is not None and outcomes["3"].result == UnloadResult("a:train:0")
    assert [outcomes[f] for f in "4578"] == [None] * 4


class Recorder:
    def __init__(self) -> None:
        self.items: list[WorkItem] = []

    def submit(self, items) -> None:  # noqa: ANN001
        self.items += items

    def step(self) -> list:
        done, self.items = self.items, []
        return [f"ran {i.future_id}" for i in done]

    def idle(self) -> bool:
        return not self.items


def test_the_gate_finishes_lost_work_itself_and_passes_the_rest_on() -> None:
    inner = Recorder()
    gate = RestartGate(inner, LOST)  # type: ignore[arg-type]
    gate.submit([item("1", "optim_step", "a:train:0", OptimStepRequest(AdamParams())), sample("2", None)])
    assert [i.future_id for i in inner.items] == ["2"] and not gate.idle()
    done = gate.step()
    assert [getattr(c, "future_id", c) for c in done] == ["1", "ran 2"] and gate.idle()


def test_settled_requests_survive_a_step_that_raises() -> None:
    """The gate took its settled completions before the runner's step: a step that raised lost them, and
    their futures stayed running (a lost run's "load_state from ..." became a generic failure at best)."""

    class Raises(Recorder):
        def step(self) -> list:
            raise RuntimeError("a device error")

    gate = RestartGate(Raises(), LOST)  # type: ignore[arg-type]
    gate.submit([item("1", "optim_step", "a:train:0", OptimStepRequest(AdamParams())), sample("2", None)])
    try:
        gate.step()
    except RuntimeError:
        pass
    gate.runner = Recorder()  # type: ignore[assignment]
    assert [c.future_id for c in gate.step()] == ["1"]

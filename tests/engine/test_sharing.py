"""Tenants sharing one model's slots and host memory: one tenant's stream of work does not shut another out.

The real `JaxRunner` over a tiny Qwen3 with 2 LoRA slots (sampling may read one) and 2 full fine-tuning
snapshots kept. A client that keeps submitting samples of a snapshot keeps its slot (or its full copy) busy;
while a save waits for that room, new samples of snapshots wait instead, the busy ones drain, the save runs,
and the held samples run after it, each as it would alone. A tenant saving snapshot after snapshot trims its
own from host memory before another tenant's idle sampling client.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from tx.engine.runner import JaxRunner
from tx.protocol import (
    CheckpointResult,
    CreateModelRequest,
    LoraConfig,
    RequestError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SaveSamplerRequest,
    UnloadModelRequest,
    WeightsRef,
    WorkItem,
)

_ids = itertools.count()
STREAM = 30  # samples of the busy snapshots, one more every step


@pytest.fixture(scope="module")
def runner(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    from engine.drive import tiny_runner

    model_dir, _ = hf_models()
    yield tiny_runner(model_dir, tmp_path_factory.mktemp("drain"), slots=2)


def _item(kind: str, model_id: str, payload: Any, owner: str = "") -> WorkItem:
    return WorkItem(f"d{next(_ids)}", kind, model_id, payload, created_at=0.0, owner=owner)  # type: ignore[arg-type]


def _ok(runner: JaxRunner, *items: WorkItem) -> list[Any]:
    runner.submit(items)
    results: dict[str, Any] = {}
    for _ in range(200):
        results.update({c.future_id: c.result for c in runner.step()})
        if runner.idle():
            break
    got = [results[i.future_id] for i in items]
    assert not [r for r in got if isinstance(r, RequestError)], got
    return got


def _sample(snapshot: str, owner: str = "") -> WorkItem:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)  # seeded: the same tokens every time
    return _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(snapshot)), owner)


def _save(run: str, snapshot: str, owner: str = "") -> WorkItem:
    return _item("save_weights_for_sampler", run, SaveSamplerRequest(snapshot), owner)


def _race(runner: JaxRunner, busy: list[str], save: WorkItem) -> dict[str, tuple[int, Any]]:
    """Samples of the `busy` snapshots, one more of each every step, and `save` submitted after the first:
    each item's step of completion and result."""
    streams = [[_sample(s) for _ in range(STREAM)] for s in busy]
    runner.submit([stream[0] for stream in streams])
    finished = {c.future_id: (-1, c.result) for c in runner.step()}
    runner.submit([save])
    for step in range(300):
        if step + 1 < STREAM:
            runner.submit([stream[step + 1] for stream in streams])  # before the earlier ones end
        finished.update((c.future_id, (step, c.result)) for c in runner.step())
        if runner.idle() and step + 1 >= STREAM:
            break
    assert runner.idle() and len(finished) == len(busy) * STREAM + 1
    return finished


def _assert_save_runs_early(finished: dict[str, tuple[int, Any]], save: WorkItem) -> None:
    step, result = finished[save.future_id]
    assert isinstance(result, CheckpointResult), result
    assert step < STREAM - 1, (step, STREAM)  # it waited for the whole stream before


def _assert_each_as_alone(finished: dict[str, tuple[int, Any]], alone: dict[str, SampleResult]) -> None:
    results = [r for _, r in finished.values() if isinstance(r, SampleResult)]
    assert results and all(r.sequences[0].tokens in [a.sequences[0].tokens for a in alone.values()] for r in results)


def _unload(runner: JaxRunner, *runs: str) -> None:
    _ok(runner, *(_item("unload_model", r, UnloadModelRequest()) for r in runs))
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def test_samples_kept_coming_do_not_hold_back_a_lora_save(runner: JaxRunner) -> None:
    """A LoRA sampler save needs two slots (its run's and the snapshot's). With sampling reading every slot it
    may (here the one), samples kept coming on snapshot a kept that slot busy and run b's save was never
    planned, nor anything of run b's after it."""
    for name in ("a", "b"):
        _ok(runner, _item("create_model", name, CreateModelRequest("m", LoraConfig(4, 8.0, seed=3))))
    _ok(runner, _save("a", "snap-a"))
    alone = {"a": _ok(runner, _sample("snap-a"))[0]}
    save = _save("b", "snap-b")
    finished = _race(runner, ["snap-a"], save)
    _assert_save_runs_early(finished, save)
    _assert_each_as_alone(finished, alone)
    _unload(runner, "a", "b")


def test_samples_kept_coming_do_not_hold_back_a_full_finetuning_save(runner: JaxRunner) -> None:
    """A full fine-tuning save makes a whole weight copy, and at most two stay while being sampled. With
    samples kept coming on both, a third save waited for good."""
    _ok(runner, _item("create_model", "f", CreateModelRequest("m", None)))
    _ok(runner, _save("f", "full-1"), _save("f", "full-2"))
    alone = {s: _ok(runner, _sample(s))[0] for s in ("full-1", "full-2")}
    save = _save("f", "full-3")
    finished = _race(runner, ["full-1", "full-2"], save)
    _assert_save_runs_early(finished, save)
    _assert_each_as_alone(finished, alone)
    _unload(runner, "f")


def test_one_tenants_stream_of_saves_trims_its_own_snapshots_before_anothers(runner: JaxRunner) -> None:
    """Host memory keeps at most --max-runs snapshots (here 3). Bob's sampling client, idle while Alice's RL
    loop saved a snapshot every step, was the least recently used one and was dropped: his next sample
    failed for good (an ephemeral snapshot has no files to reload). The tenant holding the most goes first."""
    for run, owner in (("bob-run", "bob"), ("alice-run", "alice")):
        _ok(runner, _item("create_model", run, CreateModelRequest("m", LoraConfig(4, 8.0, seed=3)), owner))
    _ok(runner, _save("bob-run", "bob:sample:0", "bob"))
    alone = _ok(runner, _sample("bob:sample:0", "bob"))[0]
    saved, runner.bank.max_runs = runner.bank.max_runs, 3
    try:
        for step in range(6):
            _ok(runner, _save("alice-run", f"alice:sample:{step}", "alice"))
            _ok(runner, _sample(f"alice:sample:{step}", "alice"))
        later = _ok(runner, _sample("bob:sample:0", "bob"))[0]
        assert later.sequences[0].tokens == alone.sequences[0].tokens
        assert len(runner.bank.host_snapshots) <= 3 and "alice:sample:0" not in runner.bank.host_snapshots
    finally:
        runner.bank.max_runs = saved
    _unload(runner, "bob-run", "alice-run")


def test_a_drain_for_adapter_slots_holds_no_sample_of_a_full_copy(runner: JaxRunner) -> None:
    """While a LoRA save waits for adapter slots, new samples of LoRA snapshots wait; samples of a full
    fine-tuning copy, which holds no adapter slot, went on waiting too (the drain paused every snapshot of the
    model). They run, as they would alone."""
    for name in ("a", "b"):
        _ok(runner, _item("create_model", name, CreateModelRequest("m", LoraConfig(4, 8.0, seed=3))))
    _ok(runner, _item("create_model", "f", CreateModelRequest("m", None)))
    _ok(runner, _save("a", "snap-a"), _save("f", "full-1"))
    alone = _ok(runner, _sample("full-1"))[0]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    runner.submit([_item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef("snap-a")))])
    finished = {c.future_id: c.result for c in runner.step()}  # snap-a's slot is being read, for a while
    runner.submit([_save("b", "snap-b")])
    finished.update((c.future_id, c.result) for c in runner.step())
    assert runner.draining == {"lora"}
    full, lora = _sample("full-1"), _sample("snap-a")
    runner.submit([full, lora])
    waiting = {item.future_id for item in runner.slot_waiting}
    assert lora.future_id in waiting and full.future_id not in waiting
    for _ in range(200):
        finished.update((c.future_id, c.result) for c in runner.step())
        if runner.idle():
            break
    assert finished[full.future_id].sequences[0].tokens == alone.sequences[0].tokens
    assert not [r for r in finished.values() if isinstance(r, RequestError)]
    _unload(runner, "a", "b", "f")

"""More runs than device slots: the real `JaxRunner` over a tiny Qwen3 with 2 LoRA slots pages idle runs and
snapshots to host memory and back. A paged run continues bit for bit as one that stayed; snapshots always get
a slot; `--max-runs` is refused by name."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest

from tx.engine.paging import Pager, PageStats
from tx.engine.runner import JaxRunner
from tx.protocol import (
    AdamParams,
    CheckpointResult,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimStepRequest,
    RequestError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SaveSamplerRequest,
    UnloadModelRequest,
    WeightsRef,
    WorkItem,
)

SLOTS = 2


@pytest.fixture(scope="module")
def runner(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    model_dir, _ = hf_models()
    config = EngineConfig(
        data_dir=tmp_path_factory.mktemp("paging"), base_model=str(model_dir), dtype="float32",
        adapters=AdapterConfig(SLOTS, 8, max_runs=6), sampler=SamplerConfig(max_rows=4, max_seq_len=64),
    )  # fmt: skip
    built, _ = build_runner(config)
    yield built


_ids = iter(range(10**6))


def _item(kind: str, model_id: str, payload: Any) -> WorkItem:
    return WorkItem(f"p{next(_ids)}", kind, model_id, payload, created_at=0.0)  # type: ignore[arg-type]


def _run(runner: JaxRunner, *items: WorkItem) -> list[Any]:
    runner.submit(items)
    results: dict[str, Any] = {}
    for _ in range(200):
        results.update({c.future_id: c.result for c in runner.step()})
        if runner.idle():
            break
    assert runner.idle()
    return [results[i.future_id] for i in items]


def _ok(runner: JaxRunner, *items: WorkItem) -> list[Any]:
    results = _run(runner, *items)
    failed = [r for r in results if isinstance(r, RequestError)]
    assert not failed, failed
    return results


def _fb(tokens: list[int], forward_only: bool = False) -> ForwardBackwardRequest:
    targets = np.array(tokens[1:] + [0], np.int64)
    return ForwardBackwardRequest(
        [Datum(tokens, {"target_tokens": targets})], "cross_entropy", forward_only=forward_only
    )


def _create(runner: JaxRunner, name: str) -> None:
    _ok(runner, _item("create_model", name, CreateModelRequest("m", LoraConfig(4, 8.0, seed=3))))


def _step(runner: JaxRunner, name: str, tokens: list[int]) -> ForwardBackwardResult:
    result = _ok(runner, _item("forward_backward", name, _fb(tokens)))[0]
    _ok(runner, _item("optim_step", name, OptimStepRequest(AdamParams(learning_rate=1e-2))))
    return result


def _touch(runner: JaxRunner, name: str) -> None:
    _ok(runner, _item("forward", name, _fb([1, 2, 3], forward_only=True)))


def _state(runner: JaxRunner, name: str) -> list[np.ndarray]:
    run = runner.trainer.runs[name]
    return [np.asarray(x) for x in jax.tree.leaves((runner.trainer.run_params(run), run.grads, run.opt_state))]


def _unload(runner: JaxRunner, *names: str) -> None:
    _ok(runner, *(_item("unload_model", n, UnloadModelRequest()) for n in names))
    assert not runner.bank.host and len(runner.slots) == 0


def _assert_moves(stats: PageStats, before: PageStats, ins: int, outs: int, within_s: float) -> None:
    """Exactly `ins` / `outs` page moves since `before`, timed: the seconds counted lie within the span."""
    assert (stats.page_ins - before.page_ins, stats.page_outs - before.page_outs) == (ins, outs)
    assert 0 < stats.seconds - before.seconds <= within_s


def test_a_paged_out_run_continues_bit_for_bit(runner: JaxRunner) -> None:
    """Two runs with the same seed and data; one is paged out and back in between steps (to another slot):
    its logprobs, gradients, Adam moments and updated weights equal those of the run that stayed."""
    _create(runner, "stay")
    _create(runner, "moved")
    for name in ("stay", "moved"):
        _step(runner, name, [5, 6, 7, 8, 9])
    _touch(runner, "stay")
    assert Pager(runner.trainer, set).stats == PageStats(page_ins=0, page_outs=0, seconds=0.0)  # counts from 0
    before, start = dataclasses.replace(runner.pager.stats), time.perf_counter()
    _create(runner, "third")  # takes the least recently used slot: "moved" goes to host memory
    assert "moved" in runner.bank.host and not runner.trainer.runs["moved"].resident
    assert runner.pager.stats.page_outs == before.page_outs + 1 and runner.bank.host["moved"].nbytes > 0
    assert "1 runs, " in runner.pager.host_report() and "latest runs: moved " in runner.pager.host_report()
    _touch(runner, "stay")
    slot_of_stay = runner.trainer.runs["stay"].slot
    results = {name: _step(runner, name, [9, 3, 4, 11, 2, 7]) for name in ("moved", "stay")}
    assert runner.trainer.runs["stay"].slot == slot_of_stay and "stay" not in runner.bank.host
    assert "third" in runner.bank.host  # "moved" came back in its place: one move in, two out
    _assert_moves(runner.pager.stats, before, ins=1, outs=2, within_s=time.perf_counter() - start)
    np.testing.assert_array_equal(results["moved"].outputs[0]["logprobs"], results["stay"].outputs[0]["logprobs"])
    for got, want in zip(_state(runner, "moved"), _state(runner, "stay"), strict=True):
        np.testing.assert_array_equal(got, want)
    assert runner.trainer.runs["moved"].step == runner.trainer.runs["stay"].step == 2
    _unload(runner, "stay", "moved", "third")


def test_snapshots_always_get_a_slot_and_come_back_from_host_memory(runner: JaxRunner) -> None:
    """With both slots held by training runs, a snapshot pages an idle run out; with more snapshots than
    slots, the older ones move to host memory and are sampled again with the same tokens."""
    for name in ("r0", "r1", "r2"):
        _create(runner, name)
        _step(runner, name, [4, 5, 6, 7])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first: dict[str, list[int]] = {}
    for name in ("r0", "r1", "r2"):
        saved = _ok(runner, _item("save_weights_for_sampler", name, SaveSamplerRequest(f"snap-{name}")))[0]
        assert isinstance(saved, CheckpointResult)
        sample = SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}"))
        result = _ok(runner, _item("sample", "s", sample))[0]
        assert isinstance(result, SampleResult)
        first[name] = result.sequences[0].tokens
    assert runner.bank.host_snapshots  # three snapshots and three runs on two slots
    runs, snaps = runner.bank.host, runner.bank.host_snapshots
    mib = (sum(h.nbytes for h in runs.values()) + sum(h.nbytes for h in snaps.values())) / 2**20
    assert f"{len(runs)} runs, {len(snaps)} snapshots, {mib:.1f} MiB in all" in runner.pager.host_report()
    for name in ("r0", "r1", "r2"):
        sample = SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}"))
        assert _ok(runner, _item("sample", "s", sample))[0].sequences[0].tokens == first[name]
    _unload(runner, "r0", "r1", "r2")
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def test_max_runs_is_refused_by_name(runner: JaxRunner) -> None:
    names = [f"n{i}" for i in range(runner.bank.max_runs)]
    for name in names:
        _create(runner, name)
    report = runner.pager.host_report()  # the log line of each page move: the host store's runs, latest last
    listed = [part.split()[0] for part in report.split("latest runs: ")[1].split(", ")]
    assert report.startswith("4 runs, ") and listed == names[:4], report
    refused = _run(runner, _item("create_model", "one-too-many", CreateModelRequest("m", LoraConfig(4, 8.0))))[0]
    assert isinstance(refused, RequestError) and refused.category == "user"
    assert "--max-runs 6" in str(refused) and "one-too-many" not in runner.trainer.runs
    _unload(runner, *names)


def test_runs_past_the_run_state_limit_are_refused_and_an_unload_gives_their_bytes_back(runner: JaxRunner) -> None:
    """`--max-run-state-gb` counts each LoRA run's state from creation to unload: exactly the bytes paging
    puts in host memory. A run past the limit is a user error naming the flag and leaves nothing behind."""
    memory, limit = runner.run_memory, runner.run_memory.limit_bytes
    _create(runner, "r0")
    per_run = memory.held["r0"]
    memory.limit_bytes = 3 * per_run
    try:
        _create(runner, "r1")
        _create(runner, "r2")  # two slots: r0 is paged out to make room
        assert not runner.trainer.runs["r0"].resident and runner.bank.host["r0"].nbytes == per_run
        refused = _run(runner, _item("create_model", "r3", CreateModelRequest("m", LoraConfig(4, 8.0))))[0]
        assert isinstance(refused, RequestError) and refused.category == "user"
        assert "--max-run-state-gb" in str(refused) and "r3" not in runner.trainer.runs
        assert "r3" not in runner.slots and set(memory.held) == {"r0", "r1", "r2"}
        _ok(runner, *(_item("unload_model", n, UnloadModelRequest()) for n in ("r1", "r0")))
        _create(runner, "r3")
        assert memory.used() == 2 * per_run
    finally:
        memory.limit_bytes = limit
    _unload(runner, "r2", "r3")
    assert memory.used() == 0


def test_host_snapshots_keep_to_the_bytes_the_runs_leave(runner: JaxRunner) -> None:
    """An RL loop saves a sampler snapshot every step: those paged out to host memory keep within the memory
    limit less the runs' state, least recently used dropped first, and give way to a new run."""
    memory, limit = runner.run_memory, runner.run_memory.limit_bytes
    _create(runner, "rl")
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def save(name: str) -> None:
        _ok(runner, _item("save_weights_for_sampler", "rl", SaveSamplerRequest(name)))

    def sample(name: str) -> Any:
        return _run(runner, _item("sample", "s", SampleRequest([1, 2], 1, params, "m", weights=WeightsRef(name))))[0]

    save("t1")
    save("t2")  # two slots, held by the run and t1: t1 goes to host memory
    snapshot = runner.bank.host_snapshots["t1"].nbytes
    memory.limit_bytes = memory.used() + 2 * snapshot + snapshot // 2
    try:
        for name in ("t3", "t4", "t5"):
            save(name)
        assert list(runner.bank.host_snapshots) == ["t3", "t4"]  # t1 and t2 dropped, oldest first
        dropped = sample("t1")
        assert isinstance(dropped, RequestError) and "not available" in str(dropped)
        assert isinstance(sample("t3"), SampleResult)
        memory.limit_bytes = 2 * memory.held["rl"] + snapshot // 2
        _create(runner, "rl2")  # t3 back on the device: a second run's state leaves no room for host snapshots
        assert not runner.bank.host_snapshots
    finally:
        memory.limit_bytes = limit
    _unload(runner, "rl", "rl2")
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def _race(runner: JaxRunner, *items: WorkItem) -> dict[str, tuple[int, float, Any]]:
    """Each item's (round it completed in, seconds since submission, result), items submitted together."""
    runner.submit(items)
    finished: dict[str, tuple[int, float, Any]] = {}
    start = time.perf_counter()
    for round_ in range(200):
        for completion in runner.step():
            finished[completion.future_id] = (round_, time.perf_counter() - start, completion.result)
        if runner.idle():
            break
    return finished


def test_a_small_request_finishes_long_before_another_tenants_large_one(runner: JaxRunner) -> None:
    """A forward_backward of many micro-batches runs one micro-batch per round (the long item), so another
    tenant's small step submitted after it completes in the first round; both report their queue wait.
    The first race compiles the shapes; the second is timed."""
    _create(runner, "big")
    _create(runner, "small")
    saved, runner.trainer.micro_batch_tokens = runner.trainer.micro_batch_tokens, 64
    rng = np.random.RandomState(0)
    data = [Datum(rng.randint(1, 200, 60).tolist(), {"target_tokens": rng.randint(1, 200, 60)}) for _ in range(48)]
    try:
        for _ in range(2):
            large = _item("forward_backward", "big", ForwardBackwardRequest(data, "cross_entropy"))
            small = _item("forward_backward", "small", _fb([3, 4, 5, 6]))
            finished = _race(runner, large, small)
    finally:
        runner.trainer.micro_batch_tokens = saved
    (small_round, small_s, small_result), (large_round, large_s, large_result) = (
        finished[small.future_id],
        finished[large.future_id],
    )
    assert small_round == 0 and large_round >= 16 and small_s < 0.2 * large_s, (small_s, large_s)
    for result in (small_result, large_result):
        assert isinstance(result, ForwardBackwardResult) and result.metrics["queue_wait_s:max"] >= 0
    assert len(large_result.outputs) == 48
    _unload(runner, "big", "small")


def test_a_deep_queue_of_near_budget_requests_does_not_hold_another_tenant_back(runner: JaxRunner) -> None:
    """Tenant "deep" queues four requests of 45 tokens on a 64-token round; "late" one of 40 after them.
    Two never fit one round together: "late" runs in the second round, as the run served least recently,
    not after the whole queue."""
    _create(runner, "deep")
    _create(runner, "late")
    saved, runner.trainer.micro_batch_tokens = runner.trainer.micro_batch_tokens, 64
    try:
        queue = [_item("forward_backward", "deep", _fb(list(range(1, 46)))) for _ in range(4)]
        late = _item("forward_backward", "late", _fb(list(range(1, 41))))
        finished = _race(runner, *queue, late)
    finally:
        runner.trainer.micro_batch_tokens = saved
    assert [finished[i.future_id][0] for i in queue] == [0, 2, 3, 4] and finished[late.future_id][0] == 1
    assert all(isinstance(result, ForwardBackwardResult) for _, _, result in finished.values())
    _unload(runner, "deep", "late")


def test_a_snapshot_coming_back_never_pages_out_a_run_mid_request(runner: JaxRunner) -> None:
    """A sample of a snapshot in host memory needs a slot while another tenant's long forward_backward is
    between micro-batches and is the least recently used owner: the slot comes from an idle run, and the
    long request's logprobs equal a forward pass of the same data afterwards (same weights, same slot)."""
    saved, runner.trainer.micro_batch_tokens = runner.trainer.micro_batch_tokens, 64
    try:
        _create(runner, "r1")
        _ok(runner, _item("save_weights_for_sampler", "r1", SaveSamplerRequest("snap-back")))
        _create(runner, "big")
        _touch(runner, "big")
        _create(runner, "r2")  # the least recently used owner, the snapshot, goes to host memory
        assert "snap-back" in runner.bank.host_snapshots
        rng = np.random.RandomState(1)
        data = [Datum(rng.randint(1, 200, 60).tolist(), {"target_tokens": rng.randint(1, 200, 60)}) for _ in range(6)]
        large = _item("forward_backward", "big", ForwardBackwardRequest(data, "cross_entropy"))
        runner.submit([large])
        done = {c.future_id: c.result for c in runner.step()}  # the long item starts: one micro-batch
        assert runner.long.runs() == {"big"}
        runner.submit([_item("forward", "r2", _fb([1, 2, 3], forward_only=True))])
        done.update({c.future_id: c.result for c in runner.step()})  # r2 is now used later than "big"
        params = SamplingParams(max_tokens=2, temperature=0.0)
        sample = _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef("snap-back")))
        before, start = dataclasses.replace(runner.pager.stats), time.perf_counter()
        done.update({future_id: result for future_id, (_, _, result) in _race(runner, sample).items()})
        assert isinstance(done[sample.future_id], SampleResult)
        _assert_moves(runner.pager.stats, before, ins=1, outs=1, within_s=time.perf_counter() - start)  # r1 out
        result = done[large.future_id]
        assert isinstance(result, ForwardBackwardResult), result
        again = _ok(runner, _item("forward", "big", ForwardBackwardRequest(data, "cross_entropy", forward_only=True)))
        for got, want in zip(result.outputs, again[0].outputs, strict=True):
            np.testing.assert_array_equal(got["logprobs"], want["logprobs"])
    finally:
        runner.trainer.micro_batch_tokens = saved
    _unload(runner, "r1", "big", "r2")
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def test_a_backlog_of_samples_leaves_training_a_slot(runner: JaxRunner) -> None:
    """Two snapshots on the two slots, each with a backlog of samples (several times the sampler's rows), and
    a training step of a third run submitted after them: sampling reads one slot at a time, so the step
    runs within the first rounds instead of after the backlog drains, and every sample equals a lone one."""
    for name in ("a", "b", "t"):
        _create(runner, name)
        _step(runner, name, [4, 5, 6, 7] if name == "a" else [9, 8, 7, 6])
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7)  # seeded: the same tokens every time

    def sample(name: str) -> WorkItem:
        return _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}")))

    alone = {}
    for name in ("a", "b"):
        _ok(runner, _item("save_weights_for_sampler", name, SaveSamplerRequest(f"snap-{name}")))
        alone[name] = _ok(runner, sample(name))[0].sequences[0]
    assert not np.allclose(alone["a"].logprobs, alone["b"].logprobs, atol=1e-5)
    backlog = [(name, sample(name)) for _ in range(12) for name in ("a", "b")]
    train = _item("forward_backward", "t", _fb([3, 1, 4, 1, 5]))
    finished = _race(runner, *(item for _, item in backlog), train)
    rounds = sorted(finished[item.future_id][0] for _, item in backlog)
    assert finished[train.future_id][0] < rounds[len(rounds) // 4], (finished[train.future_id][0], rounds)
    assert isinstance(finished[train.future_id][2], ForwardBackwardResult)
    for name, item in backlog:
        got = finished[item.future_id][2].sequences[0]
        assert got.tokens == alone[name].tokens
        np.testing.assert_allclose(got.logprobs, alone[name].logprobs, atol=1e-5)
    _unload(runner, "a", "b", "t")
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def test_samples_kept_coming_on_one_snapshot_do_not_hold_its_slot_from_another(runner: JaxRunner) -> None:
    """With the one slot sampling may read taken by snapshot a, a sample of snapshot b waits; a sample of a kept
    joining a's busy slot, so a client who kept one queued held the slot for good and b never ran. Now, while
    b waits, a's new samples wait too: a drains, b runs, then a again."""
    for name in ("a", "b"):
        _create(runner, name)
        _ok(runner, _item("save_weights_for_sampler", name, SaveSamplerRequest(f"snap-{name}")))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)

    def sample(name: str) -> WorkItem:
        return _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}")))

    stream = [sample("a") for _ in range(30)]
    waiting = sample("b")
    runner.submit([stream[0], waiting])
    finished: dict[str, int] = {}
    for round_ in range(300):
        if round_ + 1 < len(stream):
            runner.submit([stream[round_ + 1]])  # one more of a's every round, before a's earlier ones end
        finished.update((c.future_id, round_) for c in runner.step())
        if runner.idle() and round_ + 1 >= len(stream):
            break
    assert runner.idle() and len(finished) == len(stream) + 1
    assert finished[waiting.future_id] < len(stream) - 1, (finished[waiting.future_id], len(stream))
    _unload(runner, "a", "b")
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)


def test_a_page_in_that_raises_fails_only_that_runs_items_and_the_run_comes_back_later(
    runner: JaxRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device out of memory while paging a run in (the host-to-device copy raises once): the run's
    request fails alone, a base-model sample in the same step runs, the run keeps its host copy and no
    slot, and its next step equals that of a run never paged. The copy had been dropped before the
    transfer: every later request of the run raised, failing every other request of the model with it,
    and its slot stayed held for good."""
    import tx.engine.trainer as trainer_module

    fit, widenings = runner.bank._fit, iter([True])

    def widen_fails_once(at_least: int = 1) -> None:
        if next(widenings, False):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while widening the adapter stacks")
        fit(at_least)

    for name in ("twin", "victim"):
        _create(runner, name)
        _step(runner, name, [5, 6, 7, 8, 9])
    _create(runner, "pusher")  # two slots: "twin" or "victim" (least recently used) goes to host memory
    _touch(runner, "twin")
    _create(runner, "pusher2")
    assert "victim" in runner.bank.host and "twin" not in runner.bank.host
    real = trainer_module.packed_to_device
    calls = iter([True])

    def flaky(tree: Any, sharding: Any) -> Any:
        if next(calls, False):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 12.00MiB")
        return real(tree, sharding)

    monkeypatch.setattr(trainer_module, "packed_to_device", flaky)
    base = SampleRequest([1, 2, 3], 1, SamplingParams(max_tokens=3, temperature=0.0), "m")
    failed, sampled = _run(runner, _item("forward_backward", "victim", _fb([9, 3, 4])), _item("sample", "s", base))
    assert isinstance(failed, RequestError) and "out of memory" in failed.message
    assert isinstance(sampled, SampleResult) and len(sampled.sequences[0].tokens) == 3
    assert "victim" in runner.bank.host and "victim" not in runner.slots and not runner.trainer.runs["victim"].resident
    monkeypatch.setattr(runner.bank, "_fit", widen_fails_once)  # the slot's allocation raises this time
    (failed,) = _run(runner, _item("forward_backward", "victim", _fb([9, 3, 4])))
    assert isinstance(failed, RequestError) and "widening" in failed.message and "victim" not in runner.slots
    monkeypatch.setattr(runner.bank, "_fit", fit)
    _touch(runner, "twin")
    results = {name: _step(runner, name, [9, 3, 4, 11, 2, 7]) for name in ("victim", "twin")}
    np.testing.assert_array_equal(results["victim"].outputs[0]["logprobs"], results["twin"].outputs[0]["logprobs"])
    for got, want in zip(_state(runner, "victim"), _state(runner, "twin"), strict=True):
        np.testing.assert_array_equal(got, want)
    _unload(runner, "twin", "victim", "pusher", "pusher2")


def test_a_snapshot_restore_that_raises_keeps_its_host_copy_and_gives_the_slot_back(
    runner: JaxRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stashed snapshot whose write back to the device raises: the sample fails, the slot is given back,
    and the next sample reads the trained weights from host memory (it had read an empty slot: the base
    model's tokens, as a success)."""
    for name in ("a0", "a1", "a2"):
        _create(runner, name)
        _step(runner, name, [4, 5, 6, 7])
        _ok(runner, _item("save_weights_for_sampler", name, SaveSamplerRequest(f"snap-{name}")))
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def sample(name: str) -> WorkItem:
        return _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}")))

    stashed = next(n for n in ("a0", "a1", "a2") if f"snap-{n}" in runner.bank.host_snapshots)
    real, calls = runner.bank.write, iter([True])

    def flaky(slot: int, weights: Any) -> None:
        if next(calls, False):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        real(slot, weights)

    monkeypatch.setattr(runner.bank, "write", flaky)
    (failed,) = _run(runner, sample(stashed))
    assert isinstance(failed, RequestError) and "out of memory" in failed.message
    assert f"snap-{stashed}" in runner.bank.host_snapshots and f"snap-{stashed}" not in runner.slots
    trained = _ok(runner, sample(stashed))[0].sequences[0]
    base = _ok(runner, _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m")))[0].sequences[0]
    assert trained.tokens != base.tokens or not np.allclose(trained.logprobs, base.logprobs, atol=1e-6)
    _unload(runner, "a0", "a1", "a2")
    runner.bank.host_snapshots.clear()
    for info in list(runner.slots):
        runner.bank.clear(runner.bank.release(info.owner).slot)

"""Faults injected into each kind of work item fail that item alone; the other callers' results are exact.

The runner is the real `JaxRunner` over a tiny Qwen3. Faults are planted by wrapping one trainer,
checkpoint or sampler function so that it raises only for the request chosen as the culprit.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from drive import tiny_runner

from tx.engine.runner import JaxRunner
from tx.protocol import (
    AdamParams,
    CheckpointResult,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadResult,
    LoadStateRequest,
    LoadWeightsRequest,
    LoraConfig,
    OptimStepRequest,
    OptimStepResult,
    RequestError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SaveSamplerRequest,
    SaveStateRequest,
    UnloadModelRequest,
    WeightsRef,
    WorkItem,
)

CULPRIT = 77  # a datum starting with this token makes the planted fault fire


@pytest.fixture(scope="module")
def runner(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    yield tiny_runner(hf_models()[0], tmp_path_factory.mktemp("containment"), slots=8)


_ids = iter(range(10**6))


def _item(kind: str, model_id: str, payload: Any) -> WorkItem:
    return WorkItem(f"f{next(_ids)}", kind, model_id, payload, created_at=0.0)  # type: ignore[arg-type]


def _run_all(runner: JaxRunner, items: list[WorkItem]) -> dict[str, Any]:
    runner.submit(items)
    results: dict[str, Any] = {}
    for _ in range(200):
        results.update({c.future_id: c.result for c in runner.step()})
        if runner.idle():
            break
    assert runner.idle() and set(results) == {i.future_id for i in items}
    return results


def _create(runner: JaxRunner, *names: str) -> None:
    items = [_item("create_model", n, CreateModelRequest("m", LoraConfig(4, 8.0, seed=3))) for n in names]
    assert all(not isinstance(r, RequestError) for r in _run_all(runner, items).values())


def _fb(tokens: list[int]) -> ForwardBackwardRequest:
    targets = np.array(tokens[1:] + [0], np.int64)
    return ForwardBackwardRequest([Datum(tokens, {"target_tokens": targets})], "cross_entropy")


def test_a_failing_request_in_a_fused_batch_fails_alone(runner: JaxRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _create(runner, "good", "bad", "twin")
    trainer = runner.trainer
    original = trainer._run_batches

    def faulty(examples, work_of, outputs):  # type: ignore[no-untyped-def]
        yield from original(examples, work_of, outputs)  # the gradients were added: the fault comes after
        if any(int(e.tokens[0]) == CULPRIT for e in examples):
            raise RuntimeError("planted fault")

    monkeypatch.setattr(trainer, "_run_batches", faulty)
    good, bad = (
        _item("forward_backward", "good", _fb([1, 2, 3, 4])),
        _item("forward_backward", "bad", _fb([CULPRIT, 2])),
    )
    results = _run_all(runner, [good, bad])
    assert isinstance(results[bad.future_id], RequestError) and "planted fault" in results[bad.future_id].message
    assert isinstance(results[good.future_id], ForwardBackwardResult)
    # "good" was in the failed fused batch, then ran alone: its gradient is exactly that of one pass.
    alone = _run_all(runner, [_item("forward_backward", "twin", _fb([1, 2, 3, 4]))])
    step = OptimStepRequest(AdamParams(learning_rate=1e-2))
    norms = _run_all(runner, [_item("optim_step", "good", step), _item("optim_step", "twin", step)])
    assert list(alone.values())[0].metrics["loss:sum"] == results[good.future_id].metrics["loss:sum"]
    a, b = (r.metrics["grad_norm:mean"] for r in norms.values() if isinstance(r, OptimStepResult))
    assert a == pytest.approx(b, rel=1e-6) and a > 0


def test_a_full_runs_failed_batch_fails_each_request_saying_its_gradients_went(runner: JaxRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A full fine-tuning run's fused batch fails once: the trainer discards the run's accumulated gradients
    (as large as the model, not copied) and says so. Rerun one by one, the requests then succeeded and
    nobody read that the earlier forward_backward's gradients were gone."""
    items = [_item("create_model", "full-run", CreateModelRequest("m", None))]
    assert not isinstance(_run_all(runner, items)[items[0].future_id], RequestError)
    first = _item("forward_backward", "full-run", _fb([1, 2, 3, 4]))
    assert isinstance(_run_all(runner, [first])[first.future_id], ForwardBackwardResult)
    original, calls = runner.trainer.steps.full_grad, []

    def fails_once(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a transient failure")
        return original(*args)

    monkeypatch.setattr(runner.trainer.steps, "full_grad", fails_once)
    fused = [_item("forward_backward", "full-run", _fb([5, 6, 7])), _item("forward_backward", "full-run", _fb([8, 9]))]
    results = _run_all(runner, fused)
    for item in fused:
        _error(results[item.future_id], "server", "were discarded")
    assert len(calls) == 1
    _unload(runner, "full-run")


def test_a_failing_control_item_fails_once_and_alone(runner: JaxRunner, monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tx.engine import checkpoints

    _create(runner, "saver", "other")
    calls: list[Path] = []
    original = checkpoints.save

    def faulty(dest: Path, *args: Any) -> int:
        calls.append(dest)
        if dest.name == "boom":
            raise OSError(16, "Device or resource busy", str(dest))
        return original(dest, *args)

    monkeypatch.setattr(checkpoints, "save", faulty)
    monkeypatch.setattr(runner, "checkpoint_root", None)
    boom = _item("save_state", "saver", SaveStateRequest("boom", str(tmp_path / "boom"), "tinker://x/weights/boom"))
    fine = _item("save_state", "other", SaveStateRequest("fine", str(tmp_path / "fine"), "tinker://x/weights/fine"))
    after = _item("forward_backward", "saver", _fb([1, 2, 3]))
    results = _run_all(runner, [boom, fine, after])
    error = results[boom.future_id]
    assert isinstance(error, RequestError) and error.category == "server"
    assert str(tmp_path) not in error.message  # no server paths in what the caller sees
    assert not isinstance(results[fine.future_id], RequestError) and (tmp_path / "fine" / "run.json").is_file()
    assert (tmp_path / ".fine.saved-by").read_text() == fine.future_id  # for a restart: its files are in place
    assert not (tmp_path / ".boom.saved-by").exists()
    assert isinstance(results[after.future_id], ForwardBackwardResult)
    assert [p.name for p in calls].count("boom") == 1  # never re-executed


def test_a_save_that_fills_the_disk_leaves_nothing_and_says_so(runner: JaxRunner, monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Orbax reports a full disk half-way through its files: the partial checkpoint is removed (it held the
    space the next save needs) and the caller reads why, not tensorstore's message with server paths."""
    import orbax.checkpoint as ocp

    _create(runner, "filler")
    monkeypatch.setattr(runner, "checkpoint_root", None)
    write = ocp.StandardCheckpointer.save

    def fills_up(self, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
        write(self, directory, *args, **kwargs)  # the files land; then the disk "fills" before the commit ends
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database at local file "{directory}"')

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fills_up)
    item = _item("save_state", "filler", SaveStateRequest("full", str(tmp_path / "full"), "tinker://x/weights/full"))
    error = _run_all(runner, [item])[item.future_id]
    assert isinstance(error, RequestError) and "disk is full" in error.message and str(tmp_path) not in error.message
    assert error.category == "server"  # not the caller's fault, though orbax raises a ValueError
    assert not (tmp_path / "full").exists()

    def no_space(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "peft"))

    monkeypatch.setattr(runner.io, "save_peft", no_space)
    peft = _item(
        "save_weights_for_sampler",
        "filler",
        SaveSamplerRequest("s-full", name="peft", dest_dir=str(tmp_path / "peft"), tinker_path="tinker://x/s"),
    )
    error = _run_all(runner, [peft])[peft.future_id]
    assert isinstance(error, RequestError) and "disk is full" in error.message and error.category == "server"
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", write)
    again = _item("save_state", "filler", SaveStateRequest("full", str(tmp_path / "full"), "tinker://x/weights/full"))
    assert isinstance(_run_all(runner, [again])[again.future_id], CheckpointResult)
    assert (tmp_path / "full" / "run.json").is_file()
    # The disk fills while the same name is saved over: the checkpoint it would replace is left whole.
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "full").rglob("*") if p.is_file()}
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fills_up)
    over = _item("save_state", "filler", SaveStateRequest("full", str(tmp_path / "full"), "tinker://x/weights/full"))
    assert "disk is full" in _run_all(runner, [over])[over.future_id].message  # type: ignore[union-attr]
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "full").rglob("*") if p.is_file()}
    temporaries = [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".saved-by")]
    assert after == before and temporaries == []  # the marker of the save that landed stays, for a restart


def test_a_checkpoint_path_outside_the_root_fails_in_the_engine_too(runner: JaxRunner, tmp_path: Path) -> None:
    _create(runner, "escaper")
    assert runner.checkpoint_root is not None
    outside = runner.checkpoint_root / "run" / "weights" / ".."
    item = _item("save_state", "escaper", SaveStateRequest("..", str(outside), "tinker://x/weights/.."))
    result = _run_all(runner, [item])[item.future_id]
    assert isinstance(result, RequestError) and result.category == "user" and "not a valid name" in result.message
    escape = _item("save_state", "escaper", SaveStateRequest("x", str(tmp_path / "x"), "tinker://x/weights/x"))
    result = _run_all(runner, [escape])[escape.future_id]
    assert isinstance(result, RequestError) and "outside the checkpoint directory" in result.message
    assert not (tmp_path / "x").exists()


def test_a_failing_sample_row_is_retired_alone(runner: JaxRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tx.engine import sampler_rows

    original = sampler_rows.Row.advance

    def faulty(self, tokens, logprobs):  # type: ignore[no-untyped-def]
        if self.job.req.prompt[0] == CULPRIT:
            raise RuntimeError("planted row fault")
        return original(self, tokens, logprobs)

    monkeypatch.setattr(sampler_rows.Row, "advance", faulty)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    good = _item("sample", "s", SampleRequest(prompt=[1, 2, 3], num_samples=2, params=params, base_model="m"))
    bad = _item("sample", "s", SampleRequest(prompt=[CULPRIT, 2, 3], num_samples=1, params=params, base_model="m"))
    results = _run_all(runner, [good, bad])
    assert isinstance(results[bad.future_id], RequestError) and "planted row fault" in results[bad.future_id].message
    sample = results[good.future_id]
    assert isinstance(sample, SampleResult) and [len(s.tokens) for s in sample.sequences] == [6, 6]


def _unload(runner: JaxRunner, *names: str) -> None:
    """Free the slots a test's runs took (the module's runner has eight)."""
    _run_all(runner, [_item("unload_model", n, UnloadModelRequest()) for n in names])
    assert not any(n in runner.slots or n in runner.trainer.runs for n in names)


def _raise(exc: Exception) -> None:
    raise exc


def _error(result: Any, category: str, text: str) -> None:
    assert isinstance(result, RequestError) and result.category == category and text in result.message, result


def test_requests_for_a_missing_or_existing_run_fail_alone_as_user_errors(runner: JaxRunner) -> None:
    _create(runner, "taken")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    items = {
        "fb": _item("forward_backward", "ghost", _fb([1, 2, 3])),
        "step": _item("optim_step", "ghost", OptimStepRequest(AdamParams())),
        "save": _item("save_state", "ghost", SaveStateRequest("g", "/nowhere/g", "tinker://ghost/weights/g")),
        "unload": _item("unload_model", "ghost", UnloadModelRequest()),
        "again": _item("create_model", "taken", CreateModelRequest("m", LoraConfig(4, 8.0))),
        "sample": _item("sample", "s", SampleRequest([1, 2], 1, params, "m", weights=WeightsRef("never-saved"))),
        "kind": _item("frobnicate", "taken", None),
        "fine": _item("forward_backward", "taken", _fb([1, 2, 3])),
    }
    results = {name: r for name, item in items.items() for r in [_run_all(runner, [item])[item.future_id]]}
    for name in ("fb", "step", "save", "unload"):
        _error(results[name], "user", "unknown model_id 'ghost'")
    _error(results["again"], "user", "model 'taken' already exists")
    _error(results["sample"], "user", "sampler weights 'never-saved' are not available")
    _error(results["kind"], "server", "unsupported request kind 'frobnicate'")
    assert isinstance(results["fine"], ForwardBackwardResult)
    # What the engine failed on its own is discarded: never run, never reported again.
    dropped = _item("forward_backward", "taken", _fb([1, 2, 3]))
    runner.submit([dropped])
    runner.discard([dropped.future_id])
    assert runner.idle() and runner.step() == []
    _unload(runner, "taken")


def test_a_checkpoint_restores_a_run_of_its_rank_and_is_refused_by_another(
    runner: JaxRunner, monkeypatch, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(runner, "checkpoint_root", None)
    _create(runner, "keeper")
    trainer = runner.trainer

    def weights() -> dict:
        return {p: np.asarray(v) for p, v in trainer.run_params(trainer.runs["keeper"]).items()}

    saved = weights()
    save = _item("save_state", "keeper", SaveStateRequest("k", str(tmp_path / "k"), "tinker://keeper/weights/k"))
    assert isinstance(_run_all(runner, [save])[save.future_id], CheckpointResult)
    step = OptimStepRequest(AdamParams(learning_rate=1e-2))
    _run_all(runner, [_item("forward_backward", "keeper", _fb([1, 2, 3, 4])), _item("optim_step", "keeper", step)])
    assert any(not np.array_equal(saved[p], v) for p, v in weights().items())  # the step moved the adapter
    load = _item("load_state", "keeper", LoadStateRequest(str(tmp_path / "k"), "tinker://keeper/weights/k"))
    assert isinstance(_run_all(runner, [load])[load.future_id], LoadResult)
    for path, value in weights().items():
        np.testing.assert_array_equal(value, saved[path])
    wide = _item("create_model", "wide", CreateModelRequest("m", LoraConfig(8, 16.0)))
    refused = _item("load_state", "wide", LoadStateRequest(str(tmp_path / "k"), "tinker://keeper/weights/k"))
    results = _run_all(runner, [wide, refused])
    _error(results[refused.future_id], "user", "does not match model 'wide' (kind, rank or trained modules)")
    _unload(runner, "keeper", "wide")


def test_a_damaged_checkpoint_fails_by_name_and_a_failed_restore_keeps_no_run(
    runner: JaxRunner, monkeypatch, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Truncated tensor files or a garbled run.json fail the load saying the checkpoint is damaged (not a
    JSON or tensorstore message), and a create-from-state whose restore failed does not keep its slot."""
    monkeypatch.setattr(runner, "checkpoint_root", None)
    _create(runner, "source")
    saves = [
        _item("save_state", "source", SaveStateRequest(n, str(tmp_path / n), f"tinker://s/weights/{n}")) for n in "ab"
    ]
    assert all(isinstance(r, CheckpointResult) for r in _run_all(runner, saves).values())
    for data in (tmp_path / "a" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:7])
    (tmp_path / "b" / "run.json").write_text("{not json")
    runs = set(runner.trainer.runs)
    for attempt in range(3):  # each would have kept a slot of the eight
        for name in "ab":
            lora = LoraConfig(4, 8.0, seed=3)
            request = LoadWeightsRequest("m", lora, str(tmp_path / name), f"tinker://s/weights/{name}")
            item = _item("load_weights", f"from-{name}-{attempt}", request)
            result = _run_all(runner, [item])[item.future_id]
            assert isinstance(result, RequestError), type(result)
            _error(result, "server", f"checkpoint {name!r} cannot be read")
    assert set(runner.trainer.runs) == runs
    assert all(f"from-{name}-{attempt}" not in runner.slots for name in "ab" for attempt in range(3))
    peft = _item("save_weights_for_sampler", "source", SaveSamplerRequest("p", name="p", dest_dir=str(tmp_path / "p")))
    assert isinstance(_run_all(runner, [peft])[peft.future_id], CheckpointResult)
    for tensors in (tmp_path / "p").glob("*.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:100])
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for _ in range(2):  # the second try must not find a slot the first one claimed and left empty
        ref = WeightsRef("p-on-disk", "source", str(tmp_path / "p"))
        sample = _item("sample", "p-on-disk", SampleRequest([1, 2], 1, params, "m", weights=ref))
        _error(_run_all(runner, [sample])[sample.future_id], "server", "sampler checkpoint 'p' cannot be read")
    with pytest.raises(RequestError, match="sampler checkpoint 'p' cannot be read: damaged or incomplete files"):
        runner.io.load_peft(tmp_path / "p", runner.bank, 1)  # fails before the slot is written
    whole = _item("save_weights_for_sampler", "source", SaveSamplerRequest("q", name="q", dest_dir=str(tmp_path / "q")))
    assert isinstance(_run_all(runner, [whole])[whole.future_id], CheckpointResult)
    monkeypatch.setattr(runner.io, "write_peft", lambda *args: _raise(OSError(5, "Input/output error")))
    sample = _item(
        "sample",
        "q-on-disk",
        SampleRequest([1, 2], 1, params, "m", weights=WeightsRef("q-on-disk", "source", str(tmp_path / "q"))),
    )
    _error(_run_all(runner, [sample])[sample.future_id], "server", "Input/output error")
    assert "q-on-disk" not in runner.slots  # the slot claimed for the failed write is free again
    merged = shutil.copytree(runner.io.model_dir, tmp_path / "merged")  # a full fine-tuning sampler checkpoint
    for tensors in merged.glob("*.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(RequestError, match="sampler checkpoint 'merged' cannot be read: damaged or incomplete files"):
        runner.io.load_full(merged)
    _unload(runner, "source")


def test_sampler_weights_saved_again_while_being_sampled(runner: JaxRunner) -> None:
    """A save under a snapshot name that queued samples read succeeds (a loop saving "latest" while an
    evaluator samples it): the queued sample finishes on the weights it asked for, the next one reads the new
    weights, and the old copy's slot goes once a slot is needed, without a host copy."""
    _create(runner, "snapper")
    save = _item("save_weights_for_sampler", "snapper", SaveSamplerRequest("snap-a"))
    assert isinstance(_run_all(runner, [save])[save.future_id], CheckpointResult)
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def sample() -> WorkItem:
        return _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef("snap-a")))

    before = _run_all(runner, [sample()])
    _run_all(runner, [_item("forward_backward", "snapper", _fb([3, 1, 4, 1, 5, 9]))])
    _run_all(runner, [_item("optim_step", "snapper", OptimStepRequest(AdamParams(learning_rate=0.5)))])
    queued, again = sample(), _item("save_weights_for_sampler", "snapper", SaveSamplerRequest("snap-a"))
    results = _run_all(runner, [queued, again])
    assert isinstance(results[again.future_id], CheckpointResult)
    old_tokens = next(iter(before.values())).sequences[0].tokens
    assert results[queued.future_id].sequences[0].tokens == old_tokens
    retired = [info for info in runner.slots if info.kind == "retired"]
    assert [info.owner for info in retired] == [f"snap-a#retired-{retired[0].slot}"]
    after = _run_all(runner, [sample()])
    new_logprobs = next(iter(after.values())).sequences[0].logprobs
    assert new_logprobs != results[queued.future_id].sequences[0].logprobs  # the new weights
    fillers = [f"filler-{i}" for i in range(runner.slots.max_adapters - len(runner.slots) + 1)]
    _create(runner, *fillers)  # one slot more than are free: the retired copy goes first, nothing kept of it
    assert not any(info.kind == "retired" for info in runner.slots)
    assert retired[0].owner not in runner.bank.host_snapshots and "snap-a" in runner.slots
    _unload(runner, *fillers)
    _unload(runner, "snapper")
    runner.bank.clear(runner.bank.release("snap-a").slot)


def test_a_sampler_save_that_fails_leaves_its_name_on_the_files_it_had(
    runner: JaxRunner, monkeypatch, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Saved over with newer weights and the disk full: the save fails and the database gives the name its
    old checkpoint back, so its samples read the old weights; the new ones stayed in the snapshot's slot
    and were sampled under the old name until an eviction or a restart."""
    _create(runner, "overwriter")
    monkeypatch.setattr(runner, "checkpoint_root", None)
    dest = str(tmp_path / "named")
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def save() -> WorkItem:
        request = SaveSamplerRequest("named-snap", name="named", dest_dir=dest, tinker_path="tinker://o/s/named")
        return _item("save_weights_for_sampler", "overwriter", request)

    def sample() -> SampleResult:
        ref = WeightsRef("named-snap", checkpoint_dir=dest)
        item = _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=ref))
        return _run_all(runner, [item])[item.future_id]

    assert isinstance(_run_all(runner, [save()]).popitem()[1], CheckpointResult)
    before = sample().sequences[0].logprobs
    _run_all(runner, [_item("forward_backward", "overwriter", _fb([3, 1, 4, 1, 5, 9]))])
    _run_all(runner, [_item("optim_step", "overwriter", OptimStepRequest(AdamParams(learning_rate=0.5)))])

    def no_space(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", dest)

    monkeypatch.setattr(runner.io, "save_peft", no_space)
    assert isinstance(_run_all(runner, [save()]).popitem()[1], RequestError)
    np.testing.assert_allclose(sample().sequences[0].logprobs, before, rtol=1e-6)
    _unload(runner, "overwriter")
    runner.bank.clear(runner.bank.release("named-snap").slot)


def test_a_sample_the_engine_loop_failed_is_dropped_by_the_sampler(runner: JaxRunner) -> None:
    """After an unexpected step error the engine loop fails every request in flight and tells the runner to
    discard them: a sample being decoded (and one still waiting for rows) stops there, reports nothing
    later, and the next request samples as usual."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    decoding = _item("sample", "s", SampleRequest(prompt=[1, 2, 3], num_samples=4, params=params, base_model="m"))
    waiting = _item("sample", "s", SampleRequest(prompt=[4, 5], num_samples=2, params=params, base_model="m"))
    runner.submit([decoding, waiting])
    assert runner.step() == [] and not runner.idle()  # one chunk of 40 tokens decoded, rows full
    runner.discard([decoding.future_id, waiting.future_id])
    assert runner.idle() and runner.step() == []
    after = _item("sample", "s", SampleRequest(prompt=[1, 2, 3], num_samples=1, params=params, base_model="m"))
    result = _run_all(runner, [after])[after.future_id]
    assert isinstance(result, SampleResult) and len(result.sequences[0].tokens) == 40


def test_a_checkpoint_holding_nan_is_refused_by_name(runner: JaxRunner, monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A training state and a sampler checkpoint saved from weights holding a NaN (as a diverged step of an
    earlier version could leave them) are refused when loaded, as the user's error, before any slot is
    written: in a slot, a NaN poisons every adapter batched beside it."""
    monkeypatch.setattr(runner, "checkpoint_root", None)
    _create(runner, "diverged")
    run = runner.trainer.runs["diverged"]
    params = runner.trainer.run_params(run)
    first = sorted(params)[0]
    runner.trainer.set_run_params(run, {**params, first: params[first].at[(0,) * params[first].ndim].set(np.nan)})
    saves = [
        _item("save_state", "diverged", SaveStateRequest("s", str(tmp_path / "s"), "tinker://d/weights/s")),
        _item("save_weights_for_sampler", "diverged", SaveSamplerRequest("p", name="p", dest_dir=str(tmp_path / "p"))),
    ]
    assert all(isinstance(r, CheckpointResult) for r in _run_all(runner, saves).values())
    request = LoadWeightsRequest("m", LoraConfig(4, 8.0, seed=3), str(tmp_path / "s"), "tinker://d/weights/s")
    load = _item("load_weights", "from-nan", request)
    _error(_run_all(runner, [load])[load.future_id], "user", "checkpoint 's' holds values that are not finite")
    assert "from-nan" not in runner.trainer.runs and "from-nan" not in runner.slots
    ref = WeightsRef("p-on-disk", "diverged", str(tmp_path / "p"))
    params_ = SamplingParams(max_tokens=2, temperature=0.0)
    sample = _item("sample", "p-on-disk", SampleRequest([1, 2], 1, params_, "m", weights=ref))
    _error(_run_all(runner, [sample])[sample.future_id], "user", "sampler checkpoint 'p' holds values that are not")
    assert "p-on-disk" not in runner.slots
    _unload(runner, "diverged")


def test_a_sample_that_fails_on_submission_fails_alone(runner: JaxRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Handing a sample to its sampler raises (a full snapshot that does not fit back on the device, say):
    that request fails through the next step, and `submit` itself does not raise, so the engine never
    submits the batch's other items a second time."""
    submit = runner.sampler.submit

    def faulty(request_id, req, slot, group=""):  # type: ignore[no-untyped-def]
        if req.prompt[0] == CULPRIT:
            raise MemoryError("planted: no room on the device")
        return submit(request_id, req, slot, group)

    monkeypatch.setattr(runner.sampler, "submit", faulty)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    good = _item("sample", "s", SampleRequest(prompt=[1, 2, 3], num_samples=1, params=params, base_model="m"))
    bad = _item("sample", "s", SampleRequest(prompt=[CULPRIT, 2], num_samples=1, params=params, base_model="m"))
    results = _run_all(runner, [bad, good])
    _error(results[bad.future_id], "user", "planted: no room on the device")
    assert isinstance(results[good.future_id], SampleResult)


def test_a_run_whose_creation_fails_keeps_no_slot(runner: JaxRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Creating the adapter fails after its slot was claimed (out of memory, say): the slot is free again
    and the run unknown, so a later eviction never picks a slot whose run the trainer does not hold."""
    create = runner.trainer.create_lora_run
    monkeypatch.setattr(runner.trainer, "create_lora_run", lambda *args, **kwargs: _raise(MemoryError("planted")))
    item = _item("create_model", "no-room", CreateModelRequest("m", LoraConfig(4, 8.0, seed=3)))
    _error(_run_all(runner, [item])[item.future_id], "user", "planted")
    assert "no-room" not in runner.slots and "no-room" not in runner.trainer.runs
    monkeypatch.setattr(runner.trainer, "create_lora_run", create)
    _create(runner, "no-room")
    _unload(runner, "no-room")


def test_an_export_takes_no_slot_and_no_sampler_copy(runner: JaxRunner, monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """save_weights_external writes the run's files (PEFT for LoRA, a HF directory for full fine-tuning)
    straight from the run: no adapter slot and no full snapshot is left behind, and the exported adapter
    samples as the run's sampler save does."""
    monkeypatch.setattr(runner, "checkpoint_root", None)
    _create(runner, "exporter")
    full = _item("create_model", "full-exporter", CreateModelRequest("m", None))
    assert not isinstance(_run_all(runner, [full])[full.future_id], RequestError)
    slots, snapshots = {info.owner for info in runner.slots}, len(runner.full)
    requests = {
        run: SaveSamplerRequest(f"tinker://{run}/x", "snapshot", "x", str(tmp_path / run))
        for run in ("exporter", "full-exporter")
    }
    exports = [_item("save_weights_external", run, request) for run, request in requests.items()]
    assert all(isinstance(r, CheckpointResult) and r.size_bytes for r in _run_all(runner, exports).values())
    assert {info.owner for info in runner.slots} == slots and len(runner.full) == snapshots
    assert {f.name for f in (tmp_path / "exporter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert {"config.json", "model.safetensors"} <= {f.name for f in (tmp_path / "full-exporter").iterdir()}
    params = SamplingParams(max_tokens=4, temperature=0.0)
    save = _item("save_weights_for_sampler", "exporter", SaveSamplerRequest("exporter-snap"))
    assert isinstance(_run_all(runner, [save])[save.future_id], CheckpointResult)
    samples = [
        _item("sample", "s", SampleRequest([1, 2, 3], 1, params, "m", weights=ref))
        for ref in (WeightsRef("exporter-snap"), WeightsRef("exported", "exporter", str(tmp_path / "exporter")))
    ]
    results = _run_all(runner, samples)
    tokens = [results[s.future_id].sequences[0].tokens for s in samples]
    assert tokens[0] == tokens[1]
    _unload(runner, "exporter", "full-exporter")
    for snapshot in ("exporter-snap", "exported"):
        runner.bank.clear(runner.bank.release(snapshot).slot)

"""A full fine-tuning sampler checkpoint is read from disk off the engine thread: other tenants' work runs
meanwhile, the sample then reads the weights it named, and a damaged checkpoint fails only its samples."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from drive import tiny_runner

from tx.engine.runner import JaxRunner
from tx.protocol import (
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    RequestError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    WeightsRef,
    WorkItem,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def runner(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    yield tiny_runner(hf_models()[0], tmp_path_factory.mktemp("full-loads"), slots=4)


_ids = iter(range(10**6))


def _item(kind: str, model_id: str, payload: Any) -> WorkItem:
    return WorkItem(f"l{next(_ids)}", kind, model_id, payload, created_at=0.0)  # type: ignore[arg-type]


def _sample(snapshot: str | None, directory: Path | None = None) -> WorkItem:
    weights = WeightsRef(snapshot, None, str(directory)) if snapshot else None
    return _item("sample", "s", SampleRequest([1, 2, 3], 1, GREEDY, "m", weights=weights))


def _step_until(runner: JaxRunner, wanted: set[str], results: dict[str, Any]) -> None:
    for _ in range(400):
        results.update({c.future_id: c.result for c in runner.step()})
        if wanted <= set(results):
            return
    raise AssertionError(f"{wanted - set(results)} did not finish")


def test_a_full_checkpoint_is_read_while_other_work_runs(runner: JaxRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.checkpoint_root is not None
    checkpoint = Path(shutil.copytree(runner.io.model_dir, runner.checkpoint_root / "full"))  # the base weights
    gate, readers = threading.Event(), []
    read = runner.io.load_full

    def gated(directory: Path) -> dict:
        readers.append(threading.current_thread().name)
        assert gate.wait(60)
        return read(directory)

    monkeypatch.setattr(runner.io, "load_full", gated)
    create = _item("create_model", "other", CreateModelRequest("m", LoraConfig(4, 8.0, seed=1)))
    targets = np.array([3, 4, 5, 0], np.int64)
    forward = _item(
        "forward_backward",
        "other",
        ForwardBackwardRequest([Datum([2, 3, 4, 5], {"target_tokens": targets})], "cross_entropy"),
    )
    full, base = _sample("full-snap", checkpoint), _sample(None)
    runner.submit([full, create, forward, base])
    results: dict[str, Any] = {}
    _step_until(runner, {create.future_id, forward.future_id, base.future_id}, results)
    assert full.future_id not in results  # the read is held: everything else ran meanwhile
    assert isinstance(results[forward.future_id], ForwardBackwardResult)
    assert readers and readers[0].startswith("tx-snapshot-load")
    gate.set()
    _step_until(runner, {full.future_id}, results)
    got, want = results[full.future_id], results[base.future_id]
    assert isinstance(got, SampleResult) and isinstance(want, SampleResult)
    assert got.sequences[0].tokens == want.sequences[0].tokens  # the checkpoint holds the base weights
    assert len(readers) == 1  # read once, although the sample was retried every step


def test_a_damaged_full_checkpoint_fails_its_sample_alone(runner: JaxRunner) -> None:
    assert runner.checkpoint_root is not None
    damaged = Path(shutil.copytree(runner.io.model_dir, runner.checkpoint_root / "damaged"))
    for tensors in damaged.glob("*.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:100])
    bad, base = _sample("damaged-snap", damaged), _sample(None)
    runner.submit([bad, base])
    results: dict[str, Any] = {}
    _step_until(runner, {bad.future_id, base.future_id}, results)
    assert isinstance(results[base.future_id], SampleResult)
    error = results[bad.future_id]
    assert isinstance(error, RequestError) and "sampler checkpoint 'damaged' cannot be read" in str(error)
    assert runner.idle() and not runner.weights.loads.pending()


def test_checkpoints_are_read_one_at_a_time(runner: JaxRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples naming two full checkpoints: the second read starts only once the first is taken, so they
    never hold two whole weight sets beside the kept snapshots."""
    assert runner.checkpoint_root is not None
    first, second = (Path(shutil.copytree(runner.io.model_dir, runner.checkpoint_root / n)) for n in ("one", "two"))
    gate, readers = threading.Event(), []
    read = runner.io.load_full

    def gated(directory: Path) -> dict:
        readers.append(directory.name)
        assert gate.wait(60)
        return read(directory)

    monkeypatch.setattr(runner.io, "load_full", gated)
    a, b = _sample("snap-one", first), _sample("snap-two", second)
    runner.submit([a, b])
    results: dict[str, Any] = {}
    for _ in range(20):
        results.update({c.future_id: c.result for c in runner.step()})
    assert readers == ["one"] and not results and len(runner.weights.loads.pending()) == 1  # none queued behind
    gate.set()
    _step_until(runner, {a.future_id, b.future_id}, results)
    assert readers == ["one", "two"]
    assert all(isinstance(r, SampleResult) for r in results.values())

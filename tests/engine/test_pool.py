"""ModelPool on real tiny runners (Qwen3 and Llama 3): routing, loading on demand, the memory budget,
fair turns across models, and each model's compiled programs kept while others load and unload."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tx.engine import AdapterConfig, EngineConfig, build_runner
from tx.engine import pool as pool_module
from tx.engine.build import estimate_bytes
from tx.engine.compiles import compile_count
from tx.engine.pool import ModelPool, gb
from tx.engine.run_memory import RunMemory
from tx.engine.sampler import SamplerConfig
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
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

MB = 1_000_000


@pytest.fixture(scope="module")
def dirs(hf_models) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    return {"qwen": hf_models("qwen3", 2, True)[0], "llama": hf_models("llama", 2, False)[0]}


def _pool(tmp_path: Path, budget_bytes: int, memory: RunMemory | None = None) -> ModelPool:
    def build(name: str, model_dir: Path) -> Any:
        config = EngineConfig(
            data_dir=tmp_path, base_model=name, dtype="float32", adapters=AdapterConfig(2, 4),
            sampler=SamplerConfig(max_rows=4, max_seq_len=64),
        )  # fmt: skip
        return build_runner(config, model_dir, memory)

    return ModelPool(build, lambda d: estimate_bytes(d, "float32", 2), budget_bytes, memory=memory)


def _item(kind: str, model_id: str, payload: Any) -> WorkItem:
    return WorkItem(uuid.uuid4().hex, kind, model_id, payload, time.time())  # type: ignore[arg-type]


def _sample(model: Path | str, max_tokens: int = 6, seed: int = 7, snapshot: str | None = None) -> WorkItem:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop_at_eos=False)
    weights = WeightsRef(snapshot) if snapshot else None
    request = SampleRequest([3, 5, 7, 9], 1, params, str(model), weights, True, model_dir=str(model))
    return _item("sample", "sampler", request)


def _create(model_dir: Path, run_id: str, lora: bool = True) -> WorkItem:
    """A LoRA run of rank 4, or a full fine-tuning run (`lora=False`)."""
    config = LoraConfig(4) if lora else None
    return _item("create_model", run_id, CreateModelRequest(str(model_dir), config, {}, str(model_dir)))


def _fb(run_id: str) -> WorkItem:
    inputs = {"target_tokens": np.array([2, 3, 4, 5, 6, 7]), "weights": np.ones(6, np.float32)}
    request = ForwardBackwardRequest([Datum([1, 2, 3, 4, 5, 6], inputs)], "cross_entropy")
    return _item("forward_backward", run_id, request)


def _step_and_save(run_id: str, snapshot: str) -> list[WorkItem]:
    """One training step with a large learning rate (the weights move far from the base model), then an
    ephemeral sampler snapshot, as `save_weights_and_get_sampling_client` makes."""
    optim = _item("optim_step", run_id, OptimStepRequest(AdamParams(learning_rate=0.05)))
    return [_fb(run_id), optim, _item("save_weights_for_sampler", run_id, SaveSamplerRequest(snapshot))]


def _drain(pool: ModelPool, items: list[WorkItem], timeout_s: float = 300) -> dict[str, Any]:
    pool.submit(items)
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while not pool.idle() and time.monotonic() < deadline:
        done.update((c.future_id, c.result) for c in pool.step())
    assert pool.idle(), "the pool did not finish its work"
    return {item.future_id: done[item.future_id] for item in items}


def _only(results: dict[str, Any]) -> Any:
    (result,) = results.values()
    assert not isinstance(result, RequestError), result
    return result


def _same_sample(a: SampleResult, b: SampleResult) -> bool:
    same_prompt = (a.prompt_logprobs is None) == (b.prompt_logprobs is None) and (
        a.prompt_logprobs is None or np.array_equal(a.prompt_logprobs, b.prompt_logprobs, equal_nan=True)
    )
    first, second = a.sequences[0], b.sequences[0]
    return same_prompt and (first.tokens, first.logprobs) == (second.tokens, second.logprobs)


def _all_ok(results: dict[str, Any]) -> None:
    assert not [r for r in results.values() if isinstance(r, RequestError)], results


def test_budget_unloads_the_idle_model_and_reloads_it_with_its_snapshots(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Under a budget that holds one model, sampling the other unloads the idle one. Reloaded, it samples
    exactly as before: the base model, and the snapshots of `save_weights_and_get_sampling_client` (in memory
    only: LoRA ones, one paged out to host memory and one on the device, and a full fine-tuning one), which
    wait in host memory while their model is unloaded, so their sampling clients keep working."""
    pool = _pool(tmp_path, int(1.5 * MB))  # either tiny model fits (0.84 / 0.97 MB), both do not
    qwen, llama = dirs["qwen"], dirs["llama"]
    _all_ok(_drain(pool, [_create(qwen, "run-q"), *_step_and_save("run-q", "snap-1")]))
    _all_ok(_drain(pool, _step_and_save("run-q", "snap-2")))  # 2 slots: snap-1 is paged out to host memory
    _all_ok(_drain(pool, [_create(qwen, "full-q", lora=False), *_step_and_save("full-q", "snap-full")]))
    _all_ok(_drain(pool, [_item("unload_model", run, UnloadModelRequest()) for run in ("run-q", "full-q")]))
    snaps = (None, "snap-1", "snap-2", "snap-full")
    first = {snap: _only(_drain(pool, [_sample(qwen, snapshot=snap)])) for snap in snaps}
    samples = list(first.values())
    assert not any(_same_sample(a, b) for i, a in enumerate(samples) for b in samples[i + 1 :])
    assert set(pool.models) == {str(qwen)}
    qwen_weights = weakref.ref(pool.models[str(qwen)].runner.trainer.base[("model", "embed_tokens", "weight")])
    _only(_drain(pool, [_sample(llama)]))
    assert set(pool.models) == {str(llama)}, "the idle Qwen3 model was not unloaded to make room"
    assert qwen_weights() is None, "the unloaded model's weights are still held"
    for snap in reversed(snaps):
        again = _only(_drain(pool, [_sample(qwen, snapshot=snap)]))
        assert _same_sample(again, first[snap]), f"{snap or 'the base model'} sampled differently after the reload"
    assert set(pool.models) == {str(qwen)}


def test_snapshots_of_a_model_whose_directory_is_gone_are_not_held(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A model loaded from a directory since deleted (an upload, say) cannot load again, so when it is
    unloaded nothing could sample its snapshots: they are dropped, not held in host memory until restart."""
    pool = _pool(tmp_path, int(1.5 * MB))
    doomed = shutil.copytree(dirs["qwen"], tmp_path / "doomed")
    _all_ok(_drain(pool, [_create(doomed, "run-d"), *_step_and_save("run-d", "snap-d")]))
    _all_ok(_drain(pool, [_item("unload_model", "run-d", UnloadModelRequest())]))
    shutil.rmtree(doomed)
    _only(_drain(pool, [_sample(dirs["llama"])]))
    assert set(pool.models) == {str(dirs["llama"])} and pool.held == {}


def test_unloaded_models_snapshots_keep_to_the_run_state_limit(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The snapshots an unloaded model leaves in host memory count against `--max-run-state-gb` (less the runs'
    state): past it they are dropped, and sampling one fails as an evicted snapshot does."""
    memory = RunMemory(10**9)
    pool = _pool(tmp_path, int(1.5 * MB), memory)
    qwen = dirs["qwen"]
    _all_ok(_drain(pool, [_create(qwen, "run-h"), *_step_and_save("run-h", "snap-h")]))
    _all_ok(_drain(pool, [_item("unload_model", "run-h", UnloadModelRequest())]))
    memory.limit_bytes = 1  # no room left for held snapshots
    _only(_drain(pool, [_sample(dirs["llama"])]))  # unloads the idle Qwen3 model
    assert set(pool.models) == {str(dirs["llama"])} and pool.held == {}
    (lost,) = _drain(pool, [_sample(qwen, snapshot="snap-h")]).values()
    assert isinstance(lost, RequestError) and "not available" in str(lost)


def test_a_model_no_sampling_client_reads_goes_before_one_holding_snapshots(dirs, hf_models, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two models fit the budget, a third needs one gone. Both loaded ones are idle; the least recently used
    holds a sampler snapshot (a sampling client made by `save_weights_and_get_sampling_client`), the other
    holds none: that one is unloaded, and the snapshot's model stays."""
    third, _ = hf_models("qwen3", 1, True)
    pool = _pool(tmp_path, int(2.2 * MB))  # qwen 0.84 + llama 0.97 MB fit; with the third (0.8 MB) they do not
    qwen, llama = dirs["qwen"], dirs["llama"]
    _all_ok(_drain(pool, [_create(qwen, "run-k"), *_step_and_save("run-k", "kept-snap")]))
    _all_ok(_drain(pool, [_item("unload_model", "run-k", UnloadModelRequest())]))
    _only(_drain(pool, [_sample(qwen, snapshot="kept-snap")]))
    _only(_drain(pool, [_sample(llama)]))  # used after qwen: plain LRU would unload qwen
    assert set(pool.models) == {str(qwen), str(llama)}
    _only(_drain(pool, [_sample(third)]))
    assert set(pool.models) == {str(qwen), str(third)}


def test_a_model_with_a_live_run_is_never_unloaded_and_the_refusal_names_sizes(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pool = _pool(tmp_path, int(1.5 * MB))
    _only(_drain(pool, [_create(dirs["qwen"], "run-q")]))
    (refused,) = _drain(pool, [_sample(dirs["llama"])]).values()
    assert isinstance(refused, RequestError) and refused.category == "user"
    assert "MB" in refused.message and "1.50 MB (--memory-budget-gb)" in refused.message
    assert "1 live runs" in refused.message, refused.message
    assert set(pool.models) == {str(dirs["qwen"])}
    _only(_drain(pool, [_item("unload_model", "run-q", UnloadModelRequest())]))
    _only(_drain(pool, [_sample(dirs["llama"])]))  # with the run gone the Qwen3 model is idle: it makes room
    assert set(pool.models) == {str(dirs["llama"])}


def test_a_load_waits_for_a_busy_model_to_finish_and_make_room(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A budget of one model: a sample of Llama arriving while the loaded Qwen3 model samples waits for that
    sample, then Qwen3 is unloaded for it. The load had failed at once ("no loaded model is idle")."""
    pool = _pool(tmp_path, int(1.5 * MB))
    _only(_drain(pool, [_sample(dirs["qwen"])]))
    results = _drain(pool, [_sample(dirs["qwen"], max_tokens=40), _sample(dirs["llama"])])
    _all_ok(results)
    assert set(pool.models) == {str(dirs["llama"])}
    # A load whose requests were discarded while it waited leaves no spent patience behind for the next.
    busy, parked = _sample(dirs["llama"], max_tokens=40), _sample(dirs["qwen"])
    pool.submit([busy, parked])
    pool.step()
    pool.discard([parked.future_id])
    assert str(dirs["qwen"]) not in pool._room_since
    _all_ok(_drain(pool, []))


def test_no_model_is_unloaded_for_a_load_that_would_not_fit_anyway(dirs, hf_models, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3 holds a live run, Llama is idle, and a third model needs more than Llama's bytes free: the load is
    refused and Llama stays (it had been unloaded first, for nothing)."""
    third, _ = hf_models("qwen3", 1, True)
    pool = _pool(tmp_path, int(2.2 * MB))
    _only(_drain(pool, [_create(dirs["qwen"], "run-w")]))
    _only(_drain(pool, [_sample(dirs["llama"])]))
    pool.sizes[str(third)] = int(1.5 * MB)  # its measured size, as after an earlier load
    (refused,) = _drain(pool, [_sample(third)]).values()
    assert isinstance(refused, RequestError) and "1 live runs" in refused.message, refused
    assert set(pool.models) == {str(dirs["qwen"]), str(dirs["llama"])}


def test_a_load_whose_room_stays_busy_past_its_patience_says_so(dirs, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past `ROOM_PATIENCE_S` the load fails, and the refusal says the model that could go stayed busy (it had
    said the models that could go were not enough, though they were)."""
    monkeypatch.setattr(pool_module, "ROOM_PATIENCE_S", 0.0)
    pool = _pool(tmp_path, int(1.5 * MB))
    _only(_drain(pool, [_sample(dirs["qwen"])]))
    busy, refused = _drain(pool, [_sample(dirs["qwen"], max_tokens=40), _sample(dirs["llama"])]).values()
    assert not isinstance(busy, RequestError) and isinstance(refused, RequestError), (busy, refused)
    assert "stayed busy for 0 s" in refused.message, refused.message


def test_an_idle_model_is_counted_at_what_it_holds_now(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An idle Qwen3 model holds a full fine-tuning snapshot, more than its load size: unloading it makes room
    for Llama. Counted at its load size, the load was refused with nothing unloaded."""
    pool = _pool(tmp_path, int(10 * MB))
    qwen, llama = dirs["qwen"], dirs["llama"]
    _all_ok(_drain(pool, [_create(qwen, "full-q", lora=False), *_step_and_save("full-q", "snap-full")]))
    _all_ok(_drain(pool, [_item("unload_model", "full-q", UnloadModelRequest())]))
    resident, loaded_at = pool.models[str(qwen)].runner.resident_bytes(), pool.sizes[str(qwen)]
    needed = pool._size_of(str(llama))
    pool.budget_bytes = max(resident, needed) + 1000
    assert pool.budget_bytes - resident + loaded_at < needed, "the case needs the snapshot's bytes to count"
    _only(_drain(pool, [_sample(llama)]))
    assert set(pool.models) == {str(llama)}


def test_a_load_beside_a_model_loading_for_a_run_is_refused_at_once(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3 is loading for a create_model: it will hold a live run and never go, so a Llama sample that does
    not fit beside it is refused at once, not after waiting out Qwen3's load."""
    pool = _pool(tmp_path, int(1.5 * MB))
    build = pool._build

    def slow_build(name: str, model_dir: Path) -> Any:
        time.sleep(3)
        return build(name, model_dir)

    pool._build = slow_build  # type: ignore[method-assign]
    create, sample = _create(dirs["qwen"], "run-x"), _sample(dirs["llama"])
    pool.submit([create, sample])
    start, answered = time.monotonic(), None
    while answered is None and time.monotonic() - start < 60:
        answered = next((c.result for c in pool.step() if c.future_id == sample.future_id), None)
    assert isinstance(answered, RequestError) and time.monotonic() - start < 2, answered
    _all_ok(_drain(pool, []))


def test_an_upload_never_unloads_a_model_named_on_the_command_line(dirs, hf_models, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Under a budget that holds one model, one owner's upload unloaded the idle model the server was started
    with, and the run it created kept it out for every other tenant. The upload is refused with the sizes;
    a shared model loaded on demand still makes room as before."""
    uploaded, _ = hf_models("qwen3", 1, True)
    pool = _pool(tmp_path, int(1.5 * MB))
    pool.preload(str(dirs["qwen"]), dirs["qwen"])
    upload = _sample(uploaded)
    assert isinstance(upload.payload, SampleRequest)
    upload.payload.base_model = "upload:mine"
    (refused,) = _drain(pool, [upload]).values()
    assert isinstance(refused, RequestError) and "no upload unloads it" in refused.message, refused
    assert set(pool.models) == {str(dirs["qwen"])}
    _only(_drain(pool, [_sample(dirs["llama"], seed=8)]))  # not an upload: the idle model gives way
    assert set(pool.models) == {str(dirs["llama"])}


def test_a_model_larger_than_the_budget_is_refused_with_both_sizes(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pool = _pool(tmp_path, int(0.5 * MB))
    create = _create(dirs["llama"], "run-l")
    results = _drain(pool, [create, _fb("run-l")])
    assert all(isinstance(r, RequestError) for r in results.values()), "work waiting for the model did not fail"
    refused = results[create.future_id]
    assert isinstance(refused, RequestError) and refused.category == "user"
    needed = estimate_bytes(dirs["llama"], "float32", 2) / MB
    assert f"needs about {needed:.2f} MB, more than the memory budget 0.50 MB" in refused.message
    assert not pool.models


def test_models_take_fair_turns_and_keep_their_compiled_programs(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pool = _pool(tmp_path, 100 * MB)
    _only(_drain(pool, [_create(dirs["qwen"], "run-q")]))
    _only(_drain(pool, [_create(dirs["llama"], "run-l")]))
    for _ in range(2):  # warm both models' programs for this workload
        _drain(pool, [_fb("run-q"), _fb("run-l"), _sample(dirs["qwen"], 4), _sample(dirs["llama"], 4)])
    long_decode, train_llama = _sample(dirs["qwen"], max_tokens=60), _fb("run-l")
    pool.submit([long_decode, train_llama])
    first_turn = {c.future_id for c in pool.step()}
    assert train_llama.future_id in first_turn, "Llama's training waited behind Qwen3's decode"
    assert long_decode.future_id not in first_turn
    _drain(pool, [])
    # Loading a third model and unloading it again recompiles nothing of the two others.
    third = tmp_path / "third"
    from conftest import build_hf_model

    build_hf_model(third, "qwen3", 1, True, seed=3)
    _only(_drain(pool, [_sample(third, 4)]))
    before = compile_count()
    pool.unload(str(third))
    results = _drain(pool, [_fb("run-q"), _fb("run-l"), _sample(dirs["qwen"], 4), _sample(dirs["llama"], 4)])
    assert all(not isinstance(r, RequestError) for r in results.values()), results
    assert compile_count() == before, "another model's load or unload recompiled a model's programs"


def test_a_model_keyed_by_its_hub_name_is_fetched_then_loaded(dirs, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The API keys a hub model whose weights are not cached by its name; the pool's fetcher locates them
    (here in an offline HF cache) before the loader builds the model."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("2" * 40)
    shutil.copytree(dirs["qwen"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("2" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    pool = _pool(tmp_path, 100 * MB)
    by_name = _only(_drain(pool, [_sample("org/tiny")]))
    assert pool.located["org/tiny"] == snapshot and set(pool.models) == {"org/tiny"}
    by_dir = _only(_drain(pool, [_sample(dirs["qwen"])]))
    assert by_name.sequences[0].logprobs == by_dir.sequences[0].logprobs
    (missing,) = _drain(pool, [_sample("org/absent")]).values()
    assert isinstance(missing, RequestError) and "'org/absent' is not a local directory" in missing.message


def test_a_hub_model_over_the_budget_is_refused_before_its_download(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Only the config of a hub model is local (as the API fetched it): the pool sizes the model from it (an
    8B-parameter Qwen3 here: 30 GB in float32, twice that on CPU with the sampler's copy) and refuses it
    against the budget without downloading a byte of its weights, which would fill the disk first."""
    import json

    config = json.loads((dirs["qwen"] / "config.json").read_text())
    config.update(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, head_dim=128,
                  num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(json.dumps(config))
    fetched: list[str] = []
    threads: list[str] = []

    def locate(name: str) -> Path:
        fetched.append(name)
        raise AssertionError("the weights were fetched")

    pool = ModelPool(
        lambda name, model_dir: None,  # type: ignore[arg-type, return-value]
        lambda d: estimate_bytes(d, "float32", 2),
        100 * MB,
        locate=locate,
        locate_config=lambda name: threads.append(threading.current_thread().name) or tmp_path / "config-only",
    )
    (refused,) = _drain(pool, [_sample("org/huge")]).values()
    assert isinstance(refused, RequestError) and refused.category == "user", refused
    needed = gb(estimate_bytes(tmp_path / "config-only", "float32", 2))
    assert f"'org/huge' needs about {needed}, more than the memory budget 100.00 MB" in refused.message
    assert estimate_bytes(tmp_path / "config-only", "float32") >= 30e9
    assert fetched == [] and not pool.fetching
    assert threads and all(name.startswith("tx-fetch") for name in threads)  # the hub lookup: not the engine's


def test_other_models_keep_running_while_one_loads(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A load runs on the loader thread: the engine keeps stepping the loaded model meanwhile."""
    pool = _pool(tmp_path, 100 * MB)
    _only(_drain(pool, [_create(dirs["qwen"], "run-q")]))
    release = threading.Event()
    build = pool._build

    def held_build(name: str, model_dir: Path) -> Any:  # the real build, started only once the test says so
        assert release.wait(120)
        return build(name, model_dir)

    pool._build = held_build
    waiting, training = _sample(dirs["llama"]), _fb("run-q")
    pool.submit([waiting, training])
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while training.future_id not in finished and time.monotonic() < deadline:
        finished.update((c.future_id, c.result) for c in pool.step())
    assert not isinstance(finished.get(training.future_id), (RequestError, type(None))), finished
    assert waiting.future_id not in finished and str(dirs["llama"]) in pool.loading
    assert pool.parked() == 1  # the engine leaves it out of its room (`Engine._parked`)
    release.set()
    while waiting.future_id not in finished and time.monotonic() < deadline:
        finished.update((c.future_id, c.result) for c in pool.step())
    assert isinstance(finished.get(waiting.future_id), SampleResult), finished
    assert pool.parked() == 0


def test_a_step_that_fails_unexpectedly_fails_only_its_models_requests(dirs, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Llama's step raises (a planted fault the runner does not contain) in the turn where Qwen3's training
    step has run: Qwen3's completion stands, Llama's requests fail alone, and both serve afterwards. The
    error used to leave the pool, and the engine failed every request in flight, Qwen3's done one too."""
    pool = _pool(tmp_path, 100 * MB)
    _only(_drain(pool, [_create(dirs["qwen"], "run-q")]))
    _only(_drain(pool, [_create(dirs["llama"], "run-l")]))
    llama = pool.models[str(dirs["llama"])].runner

    def planted(*args: Any) -> Any:
        raise RuntimeError("planted fault")

    monkeypatch.setattr(llama, "step", planted)
    train_q, train_l, sample_l = _fb("run-q"), _fb("run-l"), _sample(dirs["llama"], 4)
    pool.submit([train_q, train_l, sample_l])
    results = {c.future_id: c.result for c in pool.step()}
    assert not isinstance(results[train_q.future_id], RequestError), results[train_q.future_id]
    for item in (train_l, sample_l):
        error = results[item.future_id]
        assert isinstance(error, RequestError) and "planted fault" in error.message
    assert pool.idle() and pool.routed == {}
    monkeypatch.undo()
    _all_ok(_drain(pool, [_fb("run-q"), _fb("run-l"), _sample(dirs["llama"], 4)]))


def test_the_estimate_counts_the_adapter_bank_a_thin_model_makes_large(tmp_path: Path) -> None:
    """The budget counted the weights alone; the bank holds every slot's A and B for every adapted matrix, so a
    model with hidden size 1 and a wide vocabulary and MLP (a 21 MB upload) built a 1.2 GB bank past it. The
    estimate is the bank as built plus the weights, and the bank grows with the slots."""
    import json

    from tx.engine.build import bank_bytes
    from tx.models.config import load_hf_config

    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1, "num_hidden_layers": 1,
              "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": 1 << 16,
              "vocab_size": 1 << 16, "max_position_embeddings": 64, "torch_dtype": "float32"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_hf_config(tmp_path, "float32")
    weights = (2 * (1 << 16) + 3 * (1 << 16)) * 4  # embeddings and head, the MLP: the bulk of the weights
    assert bank_bytes(cfg, 8) > 10 * weights
    assert bank_bytes(cfg, 8) == pytest.approx(9 / 3 * bank_bytes(cfg, 2))
    assert estimate_bytes(tmp_path, "float32", 8) - estimate_bytes(tmp_path, "float32", 2) == bank_bytes(
        cfg, 8
    ) - bank_bytes(cfg, 2)


def test_a_config_claiming_more_than_its_files_hold_is_refused_before_anything_is_built(dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The budget sizes a model from its files; a local or hub directory whose config claims far more (an
    intermediate size of 4M over 0.4 MB of weights) was built at the config's shapes (the machine-tuning
    probes, then each stacked array as its first tensor arrived) before a shape mismatch stopped it. The
    headers are checked against the config first."""
    import json

    claims = shutil.copytree(dirs["qwen"], tmp_path / "claims")
    config = json.loads((claims / "config.json").read_text())
    (claims / "config.json").write_text(json.dumps({**config, "intermediate_size": 1 << 22}))
    (refused,) = _drain(_pool(tmp_path, 10**12), [_sample(claims)]).values()  # its bank passes no budget but this
    assert isinstance(refused, RequestError) and "config.json describes" in refused.message, refused

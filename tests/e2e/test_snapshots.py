"""Sampler snapshots through the SDK: a sample sees exactly the weights it was given."""

import httpx
import pytest
from tinker import types

from e2e.conftest import KEY
from e2e.test_sdk_loops import sl_batch

pytestmark = pytest.mark.e2e


def test_training_after_a_snapshot_does_not_change_it(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=8, seed=0).result()
    batch = sl_batch(5)
    for _ in range(3):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    prompt = types.ModelInput.from_ints(batch[0].model_input.to_ints()[:4])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    frozen = client.save_weights_and_get_sampling_client().result()
    first = frozen.sample(prompt, 1, greedy).result().sequences[0]
    for _ in range(5):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    again = frozen.sample(prompt, 1, greedy).result().sequences[0]
    assert again.tokens == first.tokens and again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    fresh = client.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result().sequences[0]
    assert fresh.logprobs != pytest.approx(first.logprobs, abs=1e-3), "the next snapshot sees the update"


def _step(client, batch) -> None:  # type: ignore[no-untyped-def]
    client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()


@pytest.mark.parametrize("rank", [8, 0], ids=["lora", "full"])
def test_inflight_clients_share_the_newest_inflight_save(live, service, rank):
    """SDK 0.38's `kind="inflight"`: every inflight client of a run reads one target that each later inflight
    save updates. Each had been a snapshot of its own, so a loop holding one inflight client sampled its first
    weights for good. A snapshot client taken meanwhile keeps its weights."""
    client = service.create_lora_training_client(base_model=live.base_model, rank=rank, seed=0).result()  # 0: full
    batch = sl_batch(5)
    prompt = types.ModelInput.from_ints(batch[0].model_input.to_ints()[:6])

    def scores(sampler) -> list[float]:  # type: ignore[no-untyped-def]
        return sampler.compute_logprobs(prompt).result()[1:]

    _step(client, batch)
    first = client.save_weights_and_get_sampling_client(kind="inflight").result()
    frozen = client.save_weights_and_get_sampling_client(kind="snapshot").result()
    before = scores(first)
    assert scores(frozen) == pytest.approx(before, abs=1e-6)
    for _ in range(3):
        _step(client, batch)
    second = client.save_weights_and_get_sampling_client(kind="inflight").result()
    now = scores(second)
    assert now != pytest.approx(before, abs=1e-3), "training moved the weights"
    assert scores(first) == pytest.approx(now, abs=1e-6), "the first inflight client reads the newest save"
    assert scores(frozen) == pytest.approx(before, abs=1e-6), "a snapshot keeps its weights"


def test_a_failed_inflight_save_leaves_the_earlier_inflight_clients_sampling(live, service):
    """An inflight save that fails (its run unloaded just ahead of it) had marked the run's shared snapshot
    failed, and every earlier inflight client, whose weights the engine still held, was refused."""
    client = service.create_lora_training_client(base_model=live.base_model, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    first = client.save_weights_and_get_sampling_client(kind="inflight").result()
    tokens = first.sample(prompt, 1, greedy).result().sequences[0].tokens
    http = httpx.Client(base_url=live.url, headers={"X-API-Key": KEY}, timeout=60)
    assert http.post("/api/v1/unload_model", json={"model_id": client.model_id}).status_code == 200
    body = {"model_id": client.model_id, "sampling_session_seq_id": 900, "kind": "inflight"}
    queued = http.post("/api/v1/save_weights_for_sampler", json=body)
    if queued.status_code == 200:  # queued before the unload finished: it fails in the engine
        future = {"request_id": queued.json()["request_id"]}
        while (outcome := http.post("/api/v1/retrieve_future", json=future).json()).get("type") == "try_again":
            pass
        assert "error" in outcome, outcome
    assert first.sample(prompt, 1, greedy).result().sequences[0].tokens == tokens

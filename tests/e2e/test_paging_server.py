"""Three times more concurrent runs than device slots through the real SDK: a server with 2 LoRA slots and
6 clients, each training two steps, saving sampler weights and sampling them, all at once. Idle runs and
snapshots page to host memory and back; every request succeeds, and each client's samples are those of its
own snapshot (the same seeded request again, after its run has trained once more and the others have moved
through the slots, gives the same tokens)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import tinker
from tinker import types

from e2e.conftest import KEY, start_server
from e2e.test_sdk_loops import sl_batch

pytestmark = pytest.mark.e2e
SLOTS, RUNS = 2, 6


@pytest.fixture(scope="module")
def two_slots(hf_models, tmp_path_factory):
    model_dir, _ = hf_models("qwen3", 2, False)
    url, stop = start_server(model_dir, tmp_path_factory.mktemp("e2e-paging"), max_lora_adapters=SLOTS)
    yield url, str(model_dir)
    stop()


def _tenant(url: str, base_model: str, index: int) -> tuple[list[int], list[int]]:
    """(first sample, the same request again after one more training step of this run)."""
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + index)
    prompt = types.ModelInput.from_ints([1, 2, 3, index + 4])
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        client = service.create_lora_training_client(base_model=base_model, rank=4, seed=index).result()
        for step in range(2):
            client.forward_backward(sl_batch(10 * index + step), "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        first = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
        client.forward_backward(sl_batch(10 * index + 2), "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        again = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
        return list(first), list(again)


def test_three_times_more_runs_than_slots_all_train_save_and_sample(two_slots):
    url, base_model = two_slots
    with ThreadPoolExecutor(RUNS) as pool:
        results = list(pool.map(lambda i: _tenant(url, base_model, i), range(RUNS)))
    assert len(results) == RUNS and all(len(first) == 6 for first, _ in results)
    assert all(first == again for first, again in results)


@pytest.fixture(scope="module")
def no_run_state(hf_models, tmp_path_factory):
    model_dir, _ = hf_models("qwen3", 2, False)
    url, stop = start_server(model_dir, tmp_path_factory.mktemp("e2e-run-state"), max_run_state_bytes=1)
    yield url, str(model_dir)
    stop()


def test_a_run_past_the_run_state_limit_is_refused_by_name_and_the_server_serves_on(no_run_state):
    url, base_model = no_run_state
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        with pytest.raises(Exception, match="--max-run-state-gb"):
            service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        sampler = service.create_sampling_client(base_model=base_model)
        params = types.SamplingParams(max_tokens=4, temperature=0.0)
        result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=1, sampling_params=params).result()
        assert len(result.sequences[0].tokens) == 4

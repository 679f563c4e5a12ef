"""Sampler snapshots through the SDK: a sample sees exactly the weights it was given."""

import pytest
from tinker import types

from e2e.test_sdk_loops import sl_batch

pytestmark = pytest.mark.e2e


def test_training_after_a_snapshot_does_not_change_it(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=8).result()
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

"""Trained LoRA weights leave the real engine as PEFT files that `peft` loads onto the transformers model
with the server's logits, and an evicted named snapshot reloads from them.

A server of its own with two adapter slots: the run holds one, so each new sampler snapshot moves the least
recently used owner to host memory. Each test runs in its own session, whose end unloads its runs and frees their slots.
"""

import copy
import json

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types

from e2e.conftest import KEY, start_server
from e2e.test_sdk_loops import sl_batch
from tx.api.paths import checkpoint_dir, parse_tinker_path

pytestmark = pytest.mark.e2e
ATTN_MLP = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def two_slots(hf_models, tmp_path_factory):
    model_dir, torch_model = hf_models("qwen3", 2, False)
    data_dir = tmp_path_factory.mktemp("e2e-two-slots")
    url, stop = start_server(model_dir, data_dir, max_lora_adapters=2)
    yield url, str(model_dir), torch_model, data_dir
    stop()


def peft_logprobs(model: torch.nn.Module, datum: types.Datum) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([datum.model_input.to_ints()])).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())[:, None]
    return torch.log_softmax(logits, -1).gather(-1, targets)[:, 0].numpy()


def peft_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_trained_adapter_loads_in_peft_and_an_evicted_named_snapshot_reloads(two_slots):
    url, base_model, torch_model, data_dir = two_slots
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        export_train_and_reload(service, base_model, torch_model, data_dir)


def export_train_and_reload(service, base_model, torch_model, data_dir) -> None:
    client = service.create_lora_training_client(base_model=base_model, rank=4, train_unembed=False, seed=0).result()
    batch = sl_batch(11)
    for _ in range(3):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = client.save_weights_for_sampler("trained").result().path
    tinker_path = parse_tinker_path(path)
    assert tinker_path is not None and tinker_path.kind == "sampler_weights"
    directory = checkpoint_dir(data_dir, tinker_path)

    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], set(config["target_modules"])) == (4, 32, ATTN_MLP)
    assert config["base_model_name_or_path"] == base_model
    exported = PeftModel.from_pretrained(copy.deepcopy(torch_model), str(directory)).eval()
    server = client.forward(batch, "cross_entropy").result().loss_fn_outputs
    for datum, out in zip(batch, server, strict=True):
        ref = peft_logprobs(exported, datum)
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref, atol=1e-4)
        assert np.abs(ref - peft_logprobs(torch_model, datum)).max() > 1e-2, "training moved the logits"

    prompt = batch[0].model_input.to_ints()[:5]
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    named = service.create_sampling_client(model_path=path)
    first = named.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert first.tokens == peft_greedy(exported, prompt, 6)

    # Both slots taken (run + named snapshot): the next snapshot moves the least recently used owner to host
    # memory; each snapshot, sampled again, comes back with its own weights.
    client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    ephemeral = client.save_weights_and_get_sampling_client().result()
    moved = ephemeral.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert moved.logprobs != pytest.approx(first.logprobs, abs=1e-3)
    again = named.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert again.tokens == first.tokens and again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    back = ephemeral.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert back.tokens == moved.tokens and back.logprobs == pytest.approx(moved.logprobs, abs=1e-5)


def test_runs_past_the_slots_page_and_a_snapshot_keeps_its_weights(two_slots):
    """With both slots held, a new run pages the least recently used owner to host memory instead of being
    refused; the snapshot, sampled again after it, gives its tokens again, and every run still serves."""
    url, base_model, _, _ = two_slots
    prompt, greedy = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=2, temperature=0.0)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        first = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        snapshot = first.save_weights_and_get_sampling_client().result()
        tokens = snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens
        assert len(tokens) == 2
        second = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        third = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        assert snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens == tokens
        for client in (first, second, third):
            assert client.forward(sl_batch(2), "cross_entropy").result().metrics["loss:sum"] > 0

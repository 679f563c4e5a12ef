"""Qwen3.5 served end to end: the real SDK against a server on a tiny hub-style Qwen3.5 (the multimodal
checkpoint class, vision tower included), checked against transformers and peft.

LoRA on every projection of both layer kinds trains, exports to PEFT files that `peft` loads onto
`AutoModelForCausalLM` with the server's logprobs, samples like that PEFT model, and merges into the
hub checkpoint; full fine-tuning exports a directory transformers loads; image chunks are refused.
"""

import copy
import json

import numpy as np
import pytest
import tinker
import torch
from conftest import build_qwen3_5
from peft import PeftModel
from tinker import types

from e2e.conftest import KEY, start_server
from e2e.rl_data import rl_batch
from e2e.test_peft_export import peft_greedy, peft_logprobs
from tx.api.paths import checkpoint_dir, parse_tinker_path
from tx.lora.merge import merge_to_hf
from tx.lora.peft import load_peft

pytestmark = pytest.mark.e2e
DELTANET = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
SOFTMAX = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
VOCAB = 96


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("qwen3_5-hub")
    hf = build_qwen3_5(model_dir, multimodal=True, initializer_range=0.2)
    data_dir = tmp_path_factory.mktemp("qwen3_5-e2e")
    url, stop = start_server(model_dir, data_dir, max_lora_adapters=8)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        yield service, str(model_dir), hf, data_dir
    stop()


def batch(seed: int) -> list[types.Datum]:
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(3):
        tokens = rng.randint(0, VOCAB, int(rng.randint(8, 40))).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        ))  # fmt: skip
    return out


def text_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def train(client, data: list[types.Datum], steps: int, lr: float) -> None:
    for _ in range(steps):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=lr)).result()


def test_lora_on_both_layer_kinds_exports_to_peft_samples_and_merges(qwen3_5, tmp_path):
    service, base_model, _, data_dir = qwen3_5
    client = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    data = batch(1)
    # 1e-2 on every projection made the tiny model so sensitive that fp32 rounding alone (torch's merged model
    # against its unmerged PEFT model) reached 2e-3 in the logits; 2e-3 still moves the logprobs by > 1 nat
    train(client, data, 3, 2e-3)
    path = client.save_weights_for_sampler("trained").result().path
    directory = checkpoint_dir(data_dir, parse_tinker_path(path))
    config = json.loads((directory / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == DELTANET | SOFTMAX | MLP | {"lm_head"}

    base = text_model(base_model)
    exported = PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()
    served = client.forward(data, "cross_entropy").result().loss_fn_outputs
    for datum, out in zip(data, served, strict=True):
        ref = peft_logprobs(exported, datum)
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref, atol=1e-4)
        assert np.abs(ref - peft_logprobs(base, datum)).max() > 1e-2, "training moved the logits"

    prompt = data[0].model_input.to_ints()[:6]
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    sampler = service.create_sampling_client(model_path=path)
    got = sampler.sample(types.ModelInput.from_ints(prompt), 2, greedy).result().sequences
    assert [s.tokens for s in got] == [peft_greedy(exported, prompt, 8)] * 2

    from transformers import AutoModelForImageTextToText

    merge_to_hf(base_model, tmp_path / "merged", *load_peft(directory))
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = torch.tensor([data[1].model_input.to_ints()])
    with torch.no_grad():
        np.testing.assert_allclose(merged(tokens).logits.numpy(), exported(tokens).logits.numpy(), atol=1e-4)
    assert any(name.startswith("model.visual.") for name, _ in merged.named_parameters())


def test_full_fine_tuning_exports_a_directory_transformers_loads(qwen3_5):
    service, base_model, _, data_dir = qwen3_5
    client = service.create_lora_training_client(base_model=base_model, rank=0).result()
    data = batch(2)
    before = client.forward(data, "cross_entropy").result().loss_fn_outputs
    train(client, data, 1, 1e-3)
    served = client.forward(data, "cross_entropy").result().loss_fn_outputs
    path = client.save_weights_for_sampler("full").result().path
    exported = text_model(str(checkpoint_dir(data_dir, parse_tinker_path(path))))
    for datum, out, old in zip(data, served, before, strict=True):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), peft_logprobs(exported, datum), atol=1e-4)
        assert np.abs(out["logprobs"].to_numpy() - old["logprobs"].to_numpy()).max() > 1e-3


def test_image_chunks_are_refused_with_a_clear_error(qwen3_5):
    service, base_model, _, _ = qwen3_5
    sampler = service.create_sampling_client(base_model=base_model)
    image = types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG\r\n", format="png", expected_tokens=4)])
    with pytest.raises(tinker.BadRequestError, match="image input is not supported yet for this model"):
        sampler.sample(image, 1, types.SamplingParams(max_tokens=2)).result()


def test_fused_runs_with_different_losses_match_running_alone_and_state_resumes(qwen3_5):
    """Two runs' forward_backward calls fuse into one batch (importance_sampling beside cross_entropy); each
    run's gradient is what it gets alone, so after the same steps both equal their solo twins. A saved
    state resumes with the same weights and optimizer."""
    service, base_model, _, _ = qwen3_5
    make = lambda: service.create_lora_training_client(base_model=base_model, rank=4, seed=9).result()  # noqa: E731
    sl, rl = make(), make()
    sl_data, rl_data = batch(3), rl_batch(rl, [4, 5, 6, 7])
    adam = types.AdamParams(learning_rate=2e-2)
    futures = [sl.forward_backward(sl_data, "cross_entropy"), rl.forward_backward(rl_data, "importance_sampling")]
    fused = [f.result().metrics["loss:sum"] for f in futures]
    sl.optim_step(adam).result(), rl.optim_step(adam).result()
    solo_sl, solo_rl = make(), make()
    alone = [
        solo_sl.forward_backward(sl_data, "cross_entropy").result().metrics["loss:sum"],
        solo_rl.forward_backward(rl_data, "importance_sampling").result().metrics["loss:sum"],
    ]
    solo_sl.optim_step(adam).result(), solo_rl.optim_step(adam).result()
    # The importance-sampling sum cancels to ~2e-5 over O(1) terms: packed differently, its rounding differs
    # by ~2e-6 (seen in CI), so it needs an absolute tolerance; a wrong loss or gradient is off by far more.
    np.testing.assert_allclose(fused, alone, rtol=1e-5, atol=1e-4)
    for a, b, data in ((sl, solo_sl, sl_data), (rl, solo_rl, rl_data)):
        got = [o["logprobs"].to_numpy() for o in a.forward(data, "cross_entropy").result().loss_fn_outputs]
        want = [o["logprobs"].to_numpy() for o in b.forward(data, "cross_entropy").result().loss_fn_outputs]
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4)  # packed differently: rounding, amplified by Adam

    resumed = service.create_training_client_from_state_with_optimizer(sl.save_state("q35").result().path).result()
    for client in (sl, resumed):
        client.forward_backward(sl_data, "cross_entropy").result()
        client.optim_step(adam).result()
    a, b = (c.forward(sl_data, "cross_entropy").result().metrics["loss:sum"] for c in (sl, resumed))
    np.testing.assert_allclose(a, b, rtol=1e-5)

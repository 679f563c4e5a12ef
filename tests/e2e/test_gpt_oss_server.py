"""gpt-oss served end to end under its hub name: a tiny gpt-oss published as `openai/gpt-oss-20b` in an
offline HF cache, its experts in MXFP4 as the hub ships them, served by a real server and driven by the
real SDK. A LoRA run on attention, the fused experts and lm_head trains; its `save_weights_for_sampler`
export loads in `peft` onto transformers' GptOss (with the dequantized weights) with the server's logprobs,
and the server samples greedily as that PEFT model does, past the sliding window."""

import copy
import json

import huggingface_hub.constants
import numpy as np
import pytest
import tinker
import torch
from models.test_gpt_oss_mxfp4 import quantized_copy
from tinker import types

from e2e.conftest import KEY, start_server
from e2e.cookbook_offline import install_model
from e2e.test_peft_export import peft_greedy, peft_logprobs
from tx.api.paths import checkpoint_dir, parse_tinker_path

pytestmark = pytest.mark.e2e
HUB_NAME = "openai/gpt-oss-20b"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    quantized, dequantized = quantized_copy(tmp_path_factory.mktemp("gpt_oss-hub"))
    hf_home = tmp_path_factory.mktemp("hf-home")
    install_model(hf_home, quantized, HUB_NAME)
    with pytest.MonkeyPatch.context() as patch:  # the hub cache snapshot_download reads, for this module only
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        data_dir = tmp_path_factory.mktemp("gpt_oss-e2e")
        url, stop = start_server(HUB_NAME, data_dir, max_lora_adapters=3)
        with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
            yield service, dequantized, data_dir
        stop()


def batch(seed: int, vocab: int = 96) -> list[types.Datum]:
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(3):
        tokens = rng.randint(0, vocab, int(rng.randint(8, 30))).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        ))  # fmt: skip
    return out


def test_lora_on_the_hub_name_trains_exports_to_peft_and_samples(gpt_oss):
    from peft import PeftModel
    from transformers import GptOssForCausalLM

    service, dequantized, data_dir = gpt_oss
    client = service.create_lora_training_client(base_model=HUB_NAME, rank=4, seed=0).result()
    data = batch(1)
    for _ in range(3):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = client.save_weights_for_sampler("trained").result().path
    directory = checkpoint_dir(data_dir, parse_tinker_path(path))
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == HUB_NAME
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    base = GptOssForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    exported = PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()
    served = client.forward(data, "cross_entropy").result().loss_fn_outputs
    for datum, out in zip(data, served, strict=True):
        ref = peft_logprobs(exported, datum)
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref, atol=1e-4)
        assert np.abs(ref - peft_logprobs(base, datum)).max() > 1e-2, "training moved the logits"

    prompt = data[0].model_input.to_ints()[:6]
    greedy = types.SamplingParams(max_tokens=10, temperature=0.0)
    sampler = service.create_sampling_client(model_path=path).result()
    got = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences
    assert [s.tokens for s in got] == [peft_greedy(exported, prompt, 10)]

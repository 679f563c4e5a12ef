"""Qwen3-MoE served end to end: the real SDK against a server on a tiny Qwen3-MoE, checked against
transformers and peft. A LoRA run on attention, every routed expert and lm_head trains; its
`save_weights_for_sampler` export loads in `peft` onto transformers' fused experts with the server's
logprobs, samples like that PEFT model, and merges into the per-expert checkpoint tensors."""

import copy
import json

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from e2e.conftest import KEY, start_server
from e2e.test_peft_export import peft_greedy, peft_logprobs
from e2e.test_qwen3_5_server import batch, train
from tx.api.paths import checkpoint_dir, parse_tinker_path
from tx.lora.merge import merge_to_hf
from tx.lora.peft import load_peft

pytestmark = pytest.mark.e2e
HF = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=256, initializer_range=0.2,
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_dir = tmp_path_factory.mktemp("qwen3_moe-hub")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF)).eval().save_pretrained(model_dir)
    data_dir = tmp_path_factory.mktemp("qwen3_moe-e2e")
    url, stop = start_server(model_dir, data_dir, max_lora_adapters=3)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        yield service, str(model_dir), data_dir
    stop()


def test_lora_on_experts_trains_exports_to_peft_samples_and_merges(qwen3_moe, tmp_path):
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    service, base_model, data_dir = qwen3_moe
    client = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    data = batch(1)
    train(client, data, 3, 1e-2)
    path = client.save_weights_for_sampler("trained").result().path
    directory = checkpoint_dir(data_dir, parse_tinker_path(path))
    config = json.loads((directory / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj", "lm_head"}  # fmt: skip

    base = Qwen3MoeForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    exported = PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()
    served = client.forward(data, "cross_entropy").result().loss_fn_outputs
    for datum, out in zip(data, served, strict=True):
        ref = peft_logprobs(exported, datum)
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref, atol=1e-4)
        assert np.abs(ref - peft_logprobs(base, datum)).max() > 1e-2, "training moved the logits"

    prompt = data[0].model_input.to_ints()[:6]
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    sampler = service.create_sampling_client(model_path=path)
    got = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences
    assert [s.tokens for s in got] == [peft_greedy(exported, prompt, 8)]

    merge_to_hf(base_model, tmp_path / "merged", *load_peft(directory))
    merged = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = torch.tensor([data[1].model_input.to_ints()])
    with torch.no_grad():
        np.testing.assert_allclose(merged(tokens).logits.numpy(), exported(tokens).logits.numpy(), atol=1e-4)

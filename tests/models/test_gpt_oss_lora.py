"""LoRA on gpt-oss (attention, the fused gate_up and down experts, lm_head) against PEFT on transformers'
GptOss: our export in PEFT's `target_parameters` form loads with our logits, PEFT's gradients equal ours in
both expert-product forms, and the export, and an adapter PEFT itself made, load back into a slot."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import GPT_OSS, build_gpt_oss
from flax import nnx

from tx.lora import adapters, peft
from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.lora.peft_experts import TARGET_PARAMETERS
from tx.lora.targets import MLP_TARGETS, SOFTMAX_ATTN
from tx.models.weights import load_model
from tx.tuning import CPU

RANK, ALPHA, X = 4, 8.0, GPT_OSS["num_local_experts"]
TARGETS = frozenset({*SOFTMAX_ATTN, *MLP_TARGETS, "lm_head"})
FORMS = {
    "ragged": dataclasses.replace(CPU, moe_dense_max_experts=0),
    "dense": dataclasses.replace(CPU, moe_dense_max_experts=64),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_lora")
    build_gpt_oss(path / "base")
    return path


@pytest.fixture(scope="module")
def exported(base):
    """(model loader, adapter dir): slot 1 of a 3-slot model holds a random adapter, exported as our server
    exports gpt-oss (experts fused)."""
    models: dict = {}

    def model(form: str):
        if form not in models:
            m, _ = load_model(str(base / "base"), lora=LoRASpec(3, RANK), progress=False, tuning=FORMS[form])
            rng = np.random.RandomState(5)
            state = nnx.state(m, LoRAParam)
            for _, var in nnx.to_flat_state(state):
                var.set_value(jnp.asarray(0.1 * rng.randn(*var.shape), jnp.float32))
            nnx.update(m, state)
            models[form] = m
        return models[form]

    view = nnx.state(model("ragged"), LoRAParam)
    targets = TARGETS & adapters.adapter_targets(view)
    weights = adapters.read_slot(view, 1, RANK, targets)
    config = peft.AdapterConfig(RANK, ALPHA, tuple(sorted(targets)), str(base / "base"))
    peft.save_peft(base / "adapter", config, weights, fused_experts=True)
    return model, base / "adapter"


def rows_on(slots: list[int]) -> LoRARows:
    scale = jnp.stack([jnp.zeros(RANK), slot_scale(RANK, ALPHA, RANK), slot_scale(RANK, ALPHA, RANK)])
    return LoRARows(jnp.asarray(slots, jnp.int32), scale)


def tokens(shape=(2, 10), seed=3) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, GPT_OSS["vocab_size"], shape).astype(np.int32)


def peft_model(base, adapter, trainable: bool = False):
    from peft import PeftModel
    from transformers import GptOssForCausalLM

    ref = GptOssForCausalLM.from_pretrained(base / "base").eval()
    return PeftModel.from_pretrained(ref, str(adapter), is_trainable=trainable).eval()


def test_the_experts_adapt_gate_up_whole(exported):
    model, adapter = exported
    experts = model("ragged").model.layers.mlp.experts
    assert experts.gate_up_proj.lora_a.shape == (2, X, 3, GPT_OSS["hidden_size"], RANK)
    assert experts.gate_up_proj.lora_b.shape == (2, X, 3, RANK, 2 * GPT_OSS["intermediate_size"])
    config = json.loads((adapter / peft.CONFIG_NAME).read_text())
    assert not config["rank_pattern"] and config["target_parameters"] == TARGET_PARAMETERS


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_peft_loads_the_export_with_our_logits(base, exported, form):
    model, adapter = exported
    ids = tokens()
    mine, _ = model(form)(ids, rows=rows_on([1, 1]))
    with torch.no_grad():
        want = peft_model(base, adapter)(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    plain, _ = model(form)(ids)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)


def peft_expert_grads(module: dict, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's gradients of one layer's expert adapters as ours: {short: (A [X, in, R], B [X, R, out])}, from
    a ParamWrapper's A [X*R, in] and B [out, R*X] (rank-major); gate_up_proj nests inside down_proj."""
    out = {}
    for wrapper, short in ((module[name + ".base_layer"], "gate_up_proj"), (module[name], "down_proj")):
        a = wrapper.lora_A["default"].weight.grad.numpy().reshape(X, RANK, -1)
        b = wrapper.lora_B["default"].weight.grad.numpy()
        out[short] = (a.transpose(0, 2, 1), b.reshape(b.shape[0], RANK, X).transpose(2, 1, 0))
    return out


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_lora_gradients_match_peft(base, exported, form):
    """The experts' fused adapters and the attention's, on slot 1 (slot 2 and the base row 0 untouched)."""
    model, adapter = exported
    ids = tokens(seed=4)
    w = np.random.RandomState(7).randn(*ids.shape, GPT_OSS["vocab_size"]).astype(np.float32) / 96
    graph, lora, rest = nnx.split(model(form), LoRAParam, ...)

    def loss(lora):
        return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(ids, rows=rows_on([1, 1]))[0]) * w)

    grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss))(lora))}
    ref = peft_model(base, adapter, trainable=True)
    (torch.tanh(ref(torch.tensor(ids, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    module = dict(ref.named_modules())
    for layer in range(GPT_OSS["num_hidden_layers"]):
        want = peft_expert_grads(module, f"base_model.model.model.layers.{layer}.mlp.experts")
        for short, (a, b) in want.items():
            key = ("model", "layers", "mlp", "experts", short)
            np.testing.assert_allclose(grads[(*key, "lora_a")][layer, :, 1], a, atol=1e-4, rtol=0, err_msg=short)
            np.testing.assert_allclose(grads[(*key, "lora_b")][layer, :, 1], b, atol=1e-4, rtol=0, err_msg=short)
            assert not np.any(grads[(*key, "lora_a")][layer, :, 2])
        for short in SOFTMAX_ATTN:
            a = module[f"base_model.model.model.layers.{layer}.self_attn.{short}"].lora_A["default"].weight.grad
            mine = grads[("model", "layers", "self_attn", short, "lora_a")][layer, 1]
            np.testing.assert_allclose(mine, a.numpy().T, atol=1e-4, rtol=0, err_msg=short)


@pytest.mark.parity
def test_the_export_reads_back_as_the_slot(exported):
    model, adapter = exported
    config, weights = peft.load_peft(adapter, fused_gate_up=True)
    view = nnx.state(model("ragged"), LoRAParam)
    want = adapters.read_slot(view, 1, RANK, TARGETS & adapters.adapter_targets(view))
    assert config.rank == RANK and set(weights) == set(want)
    for name, (a, b) in want.items():
        np.testing.assert_allclose(weights[name][0], a[:, :RANK], atol=1e-7, err_msg=name)
        np.testing.assert_allclose(weights[name][1], b[:RANK], atol=1e-7, err_msg=name)


@pytest.mark.parity
def test_a_peft_trained_adapter_loads_into_a_slot(base, exported, tmp_path):
    """PEFT's own adapter on gpt-oss (target_parameters on the fused experts, random B): written into slot 2
    of our model, rows on it give PEFT's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import GptOssForCausalLM

    model, _ = exported
    ref = GptOssForCausalLM.from_pretrained(base / "base").eval()
    lora = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], target_parameters=TARGET_PARAMETERS
    )
    trained = get_peft_model(ref, lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    trained.save_pretrained(tmp_path / "theirs")
    ids = tokens(seed=6)
    with torch.no_grad():
        want = trained(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    config, weights = peft.load_peft(tmp_path / "theirs", fused_gate_up=True)
    m = model("dense")
    state = adapters.write_slot(nnx.state(m, LoRAParam), 2, config, weights)
    nnx.update(m, state)
    scale = jnp.stack([jnp.zeros(RANK), jnp.zeros(RANK), slot_scale(RANK, ALPHA, RANK)])
    mine, _ = m(ids, rows=LoRARows(jnp.asarray([2, 2], jnp.int32), scale))
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)

"""LoRA on a Qwen3-MoE's routed experts (one adapter per expert and slot) against PEFT on transformers:
our PEFT export loads onto transformers' fused experts with the same logits, its gradients equal ours in
both expert-product forms, it loads back into a slot unchanged, merges into the per-expert checkpoint
layout, and rows on different slots stay independent."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_qwen3_moe import decisive_qwen3_moe

from tx.lora import adapters, peft
from tx.lora.layers import LoRASpec
from tx.lora.merge import merge_to_hf
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.lora.targets import MLP_TARGETS, SOFTMAX_ATTN
from tx.models.weights import load_model
from tx.tuning import CPU

HF = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=64,
)  # fmt: skip
RANK, ALPHA, X, F = 4, 8.0, 4, 16
TARGETS = frozenset({*SOFTMAX_ATTN, *MLP_TARGETS, "lm_head"})
FORMS = {
    "ragged": dataclasses.replace(CPU, moe_dense_max_experts=0, moe_block_rows=0),
    "dense": dataclasses.replace(CPU, moe_dense_max_experts=64, moe_block_rows=0),
    "blocked": dataclasses.replace(CPU, moe_block_rows=2),  # blocks of 2 rows: several per expert, some padded
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint whose routers pick experts decisively."""
    ref = decisive_qwen3_moe(HF)
    path = tmp_path_factory.mktemp("qwen3_moe_lora")
    ref.save_pretrained(path / "base")
    return path


@pytest.fixture(scope="module")
def exported(base):
    """(model loader, adapter dir): slot 1 of a 3-slot model holds a random adapter, saved as PEFT."""
    models: dict = {}

    def model(form: str):
        if form not in models:
            m, _ = load_model(str(base / "base"), lora=LoRASpec(3, RANK), progress=False, tuning=FORMS[form])
            nnx.update(m, randomised(nnx.state(m, LoRAParam)))
            models[form] = m
        return models[form]

    weights = adapters.read_slot(nnx.state(model("ragged"), LoRAParam), 1, RANK, TARGETS)
    config = peft.AdapterConfig(RANK, ALPHA, tuple(sorted(TARGETS)), str(base / "base"))
    peft.save_peft(base / "adapter", config, weights)
    return model, base / "adapter"


def randomised(state: nnx.State) -> nnx.State:
    rng = np.random.RandomState(5)
    for _, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(0.1 * rng.randn(*var.shape), jnp.float32))
    return state


def rows_on(slot: list[int]) -> LoRARows:
    """Rows on slots 0-2; slots 1 and 2 at rank RANK, alpha ALPHA."""
    scale = jnp.stack([jnp.zeros(RANK), slot_scale(RANK, ALPHA, RANK), slot_scale(RANK, ALPHA, RANK)])
    return LoRARows(jnp.asarray(slot, jnp.int32), scale)


def tokens(shape=(2, 12), seed=3) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, HF["vocab_size"], shape).astype(np.int32)


def peft_model(base, adapter, trainable: bool = False):
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    ref = Qwen3MoeForCausalLM.from_pretrained(base / "base").eval()
    return PeftModel.from_pretrained(ref, str(adapter), is_trainable=trainable).eval()


def test_export_names_every_expert(exported):
    _, adapter = exported
    _, weights = peft.load_peft(adapter)
    experts = {n for n in weights if ".mlp.experts." in n}
    assert len(experts) == HF["num_hidden_layers"] * X * 3
    a, b = weights["model.layers.1.mlp.experts.3.down_proj"]
    assert a.shape == (F, RANK) and b.shape == (RANK, HF["hidden_size"])


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_peft_loads_the_export_with_our_logits(base, exported, form):
    """transformers keeps the experts fused (gate_up_proj [X, 2F, D]); PEFT converts the per-expert adapter."""
    model, adapter = exported
    ids = tokens()
    mine, _ = model(form)(ids, rows=rows_on([1, 1]))
    with torch.no_grad():
        want = peft_model(base, adapter)(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    plain, _ = model(form)(ids)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)


@pytest.mark.parity
def test_the_pairs_form_gives_peft_logits_per_row(base, exported):
    """A call of at most X pairs (one token per row, as in a decode step) runs each pair on its own: PEFT's
    logits with the adapter, and a row without one as the plain model's."""
    model, adapter = exported
    ids = tokens((2, 1), seed=5)
    assert model("blocked").model.layers.mlp.form_for(ids.size) == ("pairs", 1)
    mine, _ = model("blocked")(ids, rows=rows_on([1, 1]))
    with torch.no_grad():
        want = peft_model(base, adapter)(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)
    mixed, _ = model("blocked")(ids, rows=rows_on([1, -1]))
    plain, _ = model("dense")(ids[1:])
    np.testing.assert_allclose(np.asarray(mixed[:1]), want[:1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(mixed[1:]), np.asarray(plain), atol=1e-5, rtol=0)


def peft_grads(module: dict, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's gradients of one layer's fused expert adapters, as ours per expert: {short: (A [X, in, R],
    B [X, R, out])}. gate_up_proj holds gate and up side by side at rank 2R (B block-diagonal); PEFT lays a
    ParamWrapper's A out as [X*R', in] and its B as [out, R'*X] (rank-major)."""
    inner, outer = module[name + ".base_layer"], module[name]
    out = {}
    for wrapper, parts in ((inner, ("gate_proj", "up_proj")), (outer, ("down_proj",))):
        a = wrapper.lora_A["default"].weight.grad.numpy()
        b = wrapper.lora_B["default"].weight.grad.numpy()
        r = a.shape[0] // X
        a, b = a.reshape(X, r, -1), b.reshape(b.shape[0], r, X)
        width = b.shape[0] // len(parts)
        for i, short in enumerate(parts):
            cols, outs = slice(i * RANK, (i + 1) * RANK), slice(i * width, (i + 1) * width)
            out[short] = (a[:, cols].transpose(0, 2, 1), b[outs, cols].transpose(2, 1, 0))
    return out


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_expert_gradients_match_peft(base, exported, form):
    model, adapter = exported
    ids = tokens(seed=4)
    assert model(form).model.layers.mlp.form_for(ids.size)[0] == form
    w = np.random.RandomState(7).randn(*ids.shape, HF["vocab_size"]).astype(np.float32) / HF["vocab_size"]
    graph, lora, rest = nnx.split(model(form), LoRAParam, ...)

    def loss(lora):
        return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(ids, rows=rows_on([1, 1]))[0]) * w)

    grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss))(lora))}
    ref = peft_model(base, adapter, trainable=True)
    (torch.tanh(ref(torch.tensor(ids, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    module = dict(ref.named_modules())
    for layer in range(HF["num_hidden_layers"]):
        want = peft_grads(module, f"base_model.model.model.layers.{layer}.mlp.experts")
        for short, (a, b) in want.items():
            key = ("model", "layers", "mlp", "experts", short)
            np.testing.assert_allclose(grads[(*key, "lora_a")][layer, :, 1], a, atol=1e-4, rtol=0, err_msg=short)
            np.testing.assert_allclose(grads[(*key, "lora_b")][layer, :, 1], b, atol=1e-4, rtol=0, err_msg=short)
        q = module[f"base_model.model.model.layers.{layer}.self_attn.q_proj"].lora_A["default"].weight.grad.numpy()
        q_mine = grads[("model", "layers", "self_attn", "q_proj", "lora_a")][layer, 1]
        np.testing.assert_allclose(q_mine, q.T, atol=1e-4, rtol=0)


@pytest.mark.parity
def test_fused_export_loads_in_peft_and_back(base, exported, tmp_path):
    """The same adapter in PEFT's target_parameters form (what Qwen3.5-MoE exports use): gate and up fused
    at rank 2R, block-diagonal; peft reproduces our logits and it reads back as the per-expert weights."""
    model, adapter = exported
    config, weights = peft.load_peft(adapter)
    peft.save_peft(tmp_path / "fused", config, weights, fused_experts=True)
    assert not any(".experts.0." in n for n in safetensor_names(tmp_path / "fused"))
    ids = tokens(seed=9)
    mine, _ = model("ragged")(ids, rows=rows_on([1, 1]))
    with torch.no_grad():
        want = peft_model(base, tmp_path / "fused")(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)
    again, back = peft.load_peft(tmp_path / "fused")
    assert again.rank == RANK and set(back) == set(weights)
    for name, (a, b) in weights.items():
        np.testing.assert_allclose(back[name][0], a, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(back[name][1], b, atol=1e-7, err_msg=name)


def safetensor_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / peft.WEIGHTS_NAME), framework="numpy") as f:
        return list(f.keys())


@pytest.mark.parity
def test_a_peft_trained_fused_adapter_loads_into_a_slot(base, exported, tmp_path):
    """PEFT's own target_parameters LoRA (one A shared by gate and up) splits exactly into our layout."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeForCausalLM

    from tx.lora.peft_experts import TARGET_PARAMETERS

    ref = Qwen3MoeForCausalLM.from_pretrained(base / "base").eval()
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=TARGET_PARAMETERS,
                      init_lora_weights=False)  # fmt: skip
    theirs = get_peft_model(ref, lora).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    model = exported[0]("ragged")
    state = nnx.state(model, LoRAParam)
    nnx.update(model, adapters.write_slot(state, 2, *peft.load_peft(tmp_path / "theirs")))
    ids = tokens(seed=10)
    mine, _ = model(ids, rows=rows_on([2, 2]))
    with torch.no_grad():
        want = theirs(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)


def test_export_loads_back_into_another_slot(exported):
    model, adapter = exported
    state = nnx.state(model("ragged"), LoRAParam)
    before = adapters.read_slot(state, 1, RANK, TARGETS)
    config, weights = peft.load_peft(adapter)
    state = adapters.write_slot(state, 2, config, weights)
    after = adapters.read_slot(state, 2, RANK, TARGETS)
    nnx.update(model("ragged"), state)
    assert set(after) == set(before)
    for name, (a, b) in before.items():
        np.testing.assert_array_equal(after[name][0], a, err_msg=name)
        np.testing.assert_array_equal(after[name][1], b, err_msg=name)


@pytest.mark.parity
def test_merged_checkpoint_gives_our_logits(base, exported):
    """The merged weights land in the hub's per-expert tensors; transformers reads them back."""
    from transformers import Qwen3MoeForCausalLM

    model, adapter = exported
    config, weights = peft.load_peft(adapter)
    merge_to_hf(base / "base", base / "merged", config, weights)
    ids = tokens(seed=6)
    mine, _ = model("ragged")(ids, rows=rows_on([1, 1]))
    with torch.no_grad():
        want = Qwen3MoeForCausalLM.from_pretrained(base / "merged")(torch.tensor(ids, dtype=torch.long)).logits
    np.testing.assert_allclose(np.asarray(mine), want.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", list(FORMS))
def test_rows_on_other_slots_are_independent(exported, form):
    """A batch mixing slot 1, the zero slot and no adapter: each row as if alone."""
    model = exported[0](form)
    ids = tokens((3, 10), seed=8)
    mixed, _ = model(ids, rows=rows_on([1, 0, -1]))
    alone, _ = model(ids[:1], rows=rows_on([1]))
    plain, _ = model(ids[1:])
    np.testing.assert_allclose(np.asarray(mixed[:1]), np.asarray(alone), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(mixed[1:]), np.asarray(plain), atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_slot_of_huge_values_does_not_reach_rows_on_other_slots(exported, form):
    """Slot 2 holds an adapter trained to 1e38 (finite: an optimizer step may leave it so). Its columns
    overflow for every token beside their own slot's, and the mask's zeros made them NaN there (0 * inf):
    rows on slot 1 and without an adapter still read as if alone."""
    model = exported[0](form)
    ids = tokens((3, 10), seed=9)
    alone, _ = model(ids[:1], rows=rows_on([1]))
    plain, _ = model(ids[2:])
    lora = nnx.state(model, LoRAParam)
    kept = jax.tree.map(lambda v: v, lora)
    huge = jax.tree.map(lambda v: v.at[..., 2, :, :].set(1e38), lora)
    nnx.update(model, huge)
    try:
        mixed, _ = model(ids, rows=rows_on([1, 2, -1]))
    finally:
        nnx.update(model, kept)
    np.testing.assert_allclose(np.asarray(mixed[:1]), np.asarray(alone), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(mixed[2:]), np.asarray(plain), atol=1e-5, rtol=0)

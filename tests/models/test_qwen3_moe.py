"""Qwen3-MoE against transformers (torch CPU, float32): logits and gradients in both expert-product forms,
LoRA gradients against PEFT, packed rows, prefill + decode in both cache forms, the checkpoint layouts the
loader reads and writes, and meshes with an expert axis against one device."""

from __future__ import annotations

import dataclasses
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from models.family_checks import assert_packed_rows_match_alone, assert_sharded_matches_one_device, tokens_for
from safetensors.numpy import load_file, save_file

from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.models.causal_lm import KVCache, LayerCache, per_layer, split_layers
from tx.models.config import ModelConfig
from tx.models.sharding import make_mesh
from tx.models.weights import load_model, save_hf
from tx.tuning import CPU

HF = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
)
FORMS = {
    "ragged": dataclasses.replace(CPU, moe_dense_max_experts=0),
    "dense": dataclasses.replace(CPU, moe_dense_max_experts=64),
}


def decisive_qwen3_moe(hf: dict, perturb_norms: bool = False) -> torch.nn.Module:
    """A seeded random transformers Qwen3-MoE (eval, fp32) whose routers pick distinct experts decisively
    (router weights ~ N(0, 1)); `perturb_norms` moves the norms off 1 so that a misplaced norm shows up."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if perturb_norms and "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return ref


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """(checkpoint dir, torch model): routers scaled up so that tokens pick distinct experts decisively,
    norms perturbed so that a misplaced norm shows up."""
    ref = decisive_qwen3_moe(HF, perturb_norms=True)
    path = tmp_path_factory.mktemp("qwen3_moe")
    ref.save_pretrained(path)
    return path, ref


@pytest.fixture(scope="module")
def loaded(hf_moe):
    """form -> (model, config), each loaded once."""
    cache: dict = {}

    def get(form: str = "ragged"):
        if form not in cache:
            cache[form] = load_model(str(hf_moe[0]), progress=False, tuning=FORMS[form])
        return cache[form]

    return get


def reference(ref, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_logits_match_transformers(hf_moe, loaded, form):
    model, cfg = loaded(form)
    assert model.model.layers.mlp.form == form and cfg.moe is not None and cfg.moe.experts == 4
    tokens = tokens_for(cfg, (2, 24))
    got, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(got), reference(hf_moe[1], tokens), atol=1e-4, rtol=0)


def torch_grad(ref, cfg: ModelConfig, path: tuple[str, ...], layer: int | None) -> np.ndarray:
    """The torch gradient of our weight `path` (layer `layer` of its stack): transformers keeps the experts
    fused, gate_up_proj [X, 2F, D] (gate rows first) and down_proj [X, D, F]."""
    params = dict(ref.named_parameters())
    if layer is None:
        return params[".".join(path)].grad.numpy()
    name = ".".join((*path[:2], str(layer), *path[2:]))
    if "experts" not in path:
        return params[name].grad.numpy()
    F = cfg.moe.expert_size
    prefix = f"model.layers.{layer}.mlp.experts."
    fused = {"gate_proj": (prefix + "gate_up_proj", slice(0, F)), "up_proj": (prefix + "gate_up_proj", slice(F, None))}
    key, rows = fused.get(path[-2], (prefix + "down_proj", slice(None)))
    return params[key].grad.numpy()[:, rows]


def loss_weights(cfg: ModelConfig, shape) -> np.ndarray:
    return np.random.RandomState(7).randn(*shape, cfg.vocab_size).astype(np.float32) / cfg.vocab_size


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_full_gradients_match_torch_autograd(hf_moe, loaded, form):
    """Every weight's gradient, the router's and each expert's included."""
    _, ref = hf_moe
    model, cfg = loaded(form)
    tokens = tokens_for(cfg, (2, 20), seed=3)
    w = loss_weights(cfg, tokens.shape)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graph, params, rest)(tokens)
        return jnp.sum(jnp.tanh(logits) * w)

    grads = jax.jit(jax.grad(loss))(params)
    ref.zero_grad()
    (torch.tanh(ref(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    checked = 0
    for p, var in nnx.to_flat_state(grads):
        key, mine = tuple(map(str, p)), np.asarray(var.get_value())
        for i in range(cfg.num_layers) if key[:2] == ("model", "layers") else [None]:
            want = torch_grad(ref, cfg, key, i)
            np.testing.assert_allclose(mine if i is None else mine[i], want, atol=1e-4, rtol=0, err_msg=str((key, i)))
            checked += 1
    assert checked == len(list(ref.parameters())) + cfg.num_layers  # gate_up_proj is two weights of ours


@pytest.mark.parity
def test_attention_lora_gradients_match_peft(hf_moe):
    """Slot 1 holds a random rank-4 adapter on the attention projections and lm_head; our gradients of A
    and B equal those of the same PEFT adapter on the transformers model."""
    from peft import LoraConfig, get_peft_model

    path, ref = hf_moe
    rank, alpha = 4, 8.0
    model, cfg = load_model(str(path), lora=LoRASpec(2, rank), progress=False, tuning=FORMS["ragged"])
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    peft_model = get_peft_model(ref, LoraConfig(r=rank, lora_alpha=alpha, target_modules=names))
    try:
        modules = dict(peft_model.named_modules())
        flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}
        assert {k[-2] for k in flat} == {*names, "gate_proj", "up_proj", "down_proj"}  # experts: test_moe_lora.py
        flat = {k: v for k, v in flat.items() if k[-2] in names}
        rng = np.random.RandomState(5)
        for key, var in flat.items():
            var.set_value(jnp.asarray(0.05 * rng.randn(*var.shape), jnp.float32))
            for i, name in hf_names(key, cfg):
                value = np.asarray(var.get_value())[(1,) if i is None else (i, 1)]
                peft_factor(modules, name, key[-1]).weight.data = torch.tensor(value.T.copy())
        tokens = tokens_for(cfg, (2, 20), seed=4)
        w = loss_weights(cfg, tokens.shape)
        rows = LoRARows(jnp.ones(2, jnp.int32), jnp.stack([jnp.zeros(rank), slot_scale(rank, alpha, rank)]))
        graph, lora, rest = nnx.split(model, LoRAParam, ...)

        def loss(lora):
            return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(tokens, rows=rows)[0]) * w)

        grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.grad(loss)(lora))}
        peft_model.zero_grad()
        (torch.tanh(peft_model(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
        for key, grad in grads.items():
            for i, name in hf_names(key, cfg) if key in flat else ():
                mine = grad[(1,) if i is None else (i, 1)]
                want = peft_factor(modules, name, key[-1]).weight.grad.numpy()
                np.testing.assert_allclose(mine.T, want, atol=1e-4, rtol=0, err_msg=name)
    finally:
        peft_model.unload()  # the module-scoped transformers model goes back to its plain form


def hf_names(key: tuple[str, ...], cfg: ModelConfig) -> list[tuple[int | None, str]]:
    module = key[:-1]
    if module[:2] != ("model", "layers"):
        return [(None, ".".join(module))]
    return [(i, ".".join((*module[:2], str(i), *module[2:]))) for i in range(cfg.num_layers)]


def peft_factor(modules: dict, name: str, which: str) -> torch.nn.Module:
    return getattr(modules["base_model.model." + name], "lora_A" if which == "lora_a" else "lora_B")["default"]


def test_packed_rows_match_each_sequence_alone(loaded):
    model, cfg = loaded()
    seqs = [tokens_for(cfg, (1, n), seed=n)[0] for n in (5, 8, 3)]
    assert_packed_rows_match_alone(model, seqs, width=20)


@pytest.mark.parametrize("per_layer_weights", [False, True])
def test_prefill_then_decode_matches_full_forward(loaded, per_layer_weights):
    """The stacked `KVCache` over the stacked weights, and the `LayerCache` over per-layer weight buffers
    (the CPU sampler's form)."""
    model, cfg = loaded()
    B, P, N = 2, 7, 5
    tokens = tokens_for(cfg, (B, P + N), seed=2)
    full, _ = model(tokens)
    layers = None
    if per_layer_weights:
        flat = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
        _, layers = per_layer(split_layers(flat))
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache, layers=layers))
    cache = LayerCache.zeros(cfg, B, 16) if per_layer_weights else KVCache.zeros(cfg, B, 16)
    logits, cache = step(tokens[:, :P], jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache)
    outs = [logits]
    for i in range(P, P + N):
        logits, cache = step(tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_sizes", [dict(expert=4), dict(expert=2, tp=2)])
def test_expert_mesh_matches_single_device(hf_moe, loaded, mesh_sizes):
    model, cfg = loaded()
    tokens = tokens_for(cfg, (4, 16), seed=9)
    sharded, _ = load_model(str(hf_moe[0]), mesh=make_mesh(**mesh_sizes), progress=False, tuning=FORMS["ragged"])
    experts = sharded.model.layers.mlp.experts.gate_proj.weight[...]
    assert experts.sharding.spec[1] == "expert" and len(experts.sharding.device_set) == 4
    if "tp" in mesh_sizes:
        assert experts.sharding.spec[2] == "tp"
    assert_sharded_matches_one_device(model, sharded, tokens)


def rewritten(src, dst, edit) -> str:
    """A copy of checkpoint `src` in `dst` with its tensors passed through `edit` (dict -> dict)."""
    shutil.copytree(src, dst)
    save_file(edit(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    return str(dst)


def fused(tensors: dict) -> dict:
    """The per-expert tensors as transformers 5 holds them in memory: gate_up_proj [X, 2F, D], down_proj [X, D, F]."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(HF["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        per = [
            [tensors[f"{p}{e}.{name}.weight"] for e in range(HF["num_experts"])] for name in ("gate_proj", "up_proj")
        ]
        out[p + "gate_up_proj"] = np.concatenate([np.stack(per[0]), np.stack(per[1])], axis=1)
        out[p + "down_proj"] = np.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(HF["num_experts"])])
    return out


def test_fused_expert_layout_loads_the_same_weights(hf_moe, loaded, tmp_path):
    model, cfg = loaded()
    other, _ = load_model(rewritten(hf_moe[0], tmp_path / "m", fused), progress=False, tuning=FORMS["ragged"])
    for (p, mine), (_, want) in zip(
        nnx.to_flat_state(nnx.state(other)), nnx.to_flat_state(nnx.state(model)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(mine.get_value()), np.asarray(want.get_value()), err_msg=str(p))


EXPERT = "model.layers.0.mlp.experts."


@pytest.mark.parametrize(
    "drop,add,message",
    [
        (EXPERT + "3.up_proj.weight", None, f"missing tensor '{EXPERT}3.up_proj.weight'"),
        (None, (EXPERT + "4.up_proj.weight", EXPERT + "0.up_proj.weight"), "expert 4 of a model with 4 experts"),
        (None, (EXPERT + "gate_proj.weight", EXPERT + "0.gate_proj.weight"), "experts.gate_proj.weight per expert"),
    ],
)  # fmt: skip
def test_bad_expert_tensors_are_named(hf_moe, tmp_path, drop, add, message):
    """A missing expert, one expert too many, and a weight the model keeps per expert given whole."""

    def edit(tensors: dict) -> dict:
        tensors = {k: v for k, v in tensors.items() if k != drop}
        return {**tensors, add[0]: tensors[add[1]]} if add else tensors

    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(rewritten(hf_moe[0], tmp_path / "m", edit), progress=False)


def test_save_hf_writes_the_hub_layout_back(hf_moe, loaded, tmp_path):
    """Full fine-tuning export, from the stacked weights and from per-layer buffers: every per-expert tensor
    back under its own name."""
    model, cfg = loaded()
    params = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    original = load_file(hf_moe[0] / "model.safetensors")
    for name, weights in (("stacked", params), ("split", split_layers(params))):
        save_hf(weights, cfg, hf_moe[0], tmp_path / name)
        written = load_file(tmp_path / name / "model.safetensors")
        assert set(written) == set(original)
        for key, value in original.items():
            np.testing.assert_array_equal(written[key], value, err_msg=key)

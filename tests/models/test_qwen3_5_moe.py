"""Qwen3.5-MoE against transformers (torch CPU, float32): the config of both checkpoint classes (unknown
fields rejected), logits of both, every weight's gradient (experts, router, shared expert and its gate
included), LoRA gradients of the mixers and the shared expert against PEFT, prefill + decode, packed rows, and
meshes with an expert axis against one device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import QWEN3_5_TEXT, QWEN3_5_VISION
from flax import nnx
from models.family_checks import assert_packed_rows_match_alone, assert_sharded_matches_one_device, tokens_for

from tx.lora import adapters, peft
from tx.lora.layers import LoRASpec
from tx.lora.merge import merge_to_hf
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.models.cache import HybridCache
from tx.models.config import ModelConfig
from tx.models.config_qwen3_5 import qwen3_5_from_hf
from tx.models.weights import load_model
from tx.tuning import CPU

X, K, F, SHARED = 4, 2, 16, 24
TEXT = {k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"}
TEXT.update(
    num_hidden_layers=4, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED, num_experts=X,
    num_experts_per_tok=K,
)  # fmt: skip


def build(path, multimodal: bool):
    """A tiny random Qwen3.5-MoE saved to `path` (norms, gating and routers perturbed so that misplacing
    one shows up); returns the torch model."""
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    torch.manual_seed(0)
    if multimodal:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=TEXT, vision_config=QWEN3_5_VISION))
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TEXT))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 1.0)
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict = {}

    def get(multimodal: bool = False):
        if multimodal not in cache:
            path = tmp_path_factory.mktemp(f"qwen3_5_moe-{'mm' if multimodal else 'text'}")
            ref = build(path, multimodal)
            cache[multimodal] = (path, ref, *load_model(str(path), progress=False))
        return cache[multimodal]

    return get


def test_config_reads_the_moe_section_and_rejects_unknown_fields(models):
    import json

    path, _, _, cfg = models()
    assert cfg.family == "qwen3_5_moe" and cfg.moe is not None
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.expert_size, cfg.moe.shared_expert_size) == (X, K, F, SHARED)
    assert cfg.moe.norm_topk_prob and cfg.moe.sparse_layers == (0, 1, 2, 3)
    hf = json.loads((path / "config.json").read_text())
    for field in ("intermediate_size", "decoder_sparse_step"):  # a dense MLP width; a Qwen3-MoE field
        with pytest.raises(ValueError, match=rf"qwen3_5_moe: \['{field}'\]"):
            qwen3_5_from_hf({**hf, field: 1})


@pytest.mark.parity
@pytest.mark.parametrize("multimodal", [False, True])
def test_logits_match_transformers(models, multimodal):
    _, ref, model, cfg = models(multimodal)
    assert cfg.checkpoint_prefix.endswith("language_model") == multimodal
    tokens = tokens_for(cfg, (2, 70))  # two chunks of the delta rule, the second one partial
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def torch_grad(ref, cfg: ModelConfig, path: tuple[str, ...], index: int | None) -> np.ndarray:
    """The torch gradient of our `path` (entry `index` of its stack); transformers fuses the experts'
    gate and up projections into gate_up_proj [X, 2F, D] (gate rows first)."""
    params = dict(ref.named_parameters())
    if index is None:
        return params[".".join(path)].grad.numpy()
    layer = cfg.layers_holding(path[2])[index]
    name = ".".join((*path[:2], str(layer), *path[2:]))
    if "experts" not in path or path[-2] == "down_proj":
        return params[name.replace(".experts.down_proj.weight", ".experts.down_proj")].grad.numpy()
    rows = slice(0, F) if path[-2] == "gate_proj" else slice(F, None)
    return params[name.rsplit(".", 2)[0] + ".gate_up_proj"].grad.numpy()[:, rows]


def loss_weights(cfg: ModelConfig, shape) -> np.ndarray:
    return np.random.RandomState(7).randn(*shape, cfg.vocab_size).astype(np.float32) / cfg.vocab_size


@pytest.mark.parity
def test_full_gradients_match_torch_autograd(models):
    _, ref, model, cfg = models()
    tokens = tokens_for(cfg, (2, 40), seed=3)
    w = loss_weights(cfg, tokens.shape)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return jnp.sum(jnp.tanh(nnx.merge(graph, params, rest)(tokens)[0]) * w)

    grads = jax.jit(jax.grad(loss))(params)
    ref.zero_grad()
    (torch.tanh(ref(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    checked = 0
    for p, var in nnx.to_flat_state(grads):
        key, mine = tuple(map(str, p)), np.asarray(var.get_value())
        for i in range(mine.shape[0]) if key[:2] == ("model", "layers") else [None]:
            want = torch_grad(ref, cfg, key, i)
            np.testing.assert_allclose(mine if i is None else mine[i], want, atol=1e-4, rtol=0, err_msg=str((key, i)))
            checked += 1
    assert checked == len(list(ref.parameters())) + cfg.num_layers  # gate_up_proj is two weights of ours


@pytest.mark.parity
def test_lora_gradients_of_mixers_and_shared_expert_match_peft(models):
    """A random rank-4 adapter on both mixers' projections, the shared expert and lm_head (the routed
    experts' adapters zero: `test_moe_lora.py` checks those against PEFT); our gradients equal PEFT's."""
    from peft import LoraConfig, get_peft_model

    path, ref, _, _ = models()
    rank, alpha = 4, 8.0
    model, cfg = load_model(str(path), lora=LoRASpec(2, rank), progress=False)
    names = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj"]
    names += ["o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]  # transformers 5: only the shared expert's
    peft_model = get_peft_model(ref, LoraConfig(r=rank, lora_alpha=alpha, target_modules=names))
    try:
        modules = dict(peft_model.named_modules())
        flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}
        flat = {k: v for k, v in flat.items() if "experts" not in k}
        rng = np.random.RandomState(5)
        for key, var in flat.items():
            var.set_value(jnp.asarray(0.05 * rng.randn(*var.shape), jnp.float32))
            for index, name in hf_names(key, cfg, var.shape):
                peft_factor(modules, name, key[-1]).weight.data = torch.tensor(
                    np.asarray(var.get_value())[index].T.copy()
                )
        tokens = tokens_for(cfg, (2, 40), seed=4)
        w = loss_weights(cfg, tokens.shape)
        rows = LoRARows(jnp.ones(2, jnp.int32), jnp.stack([jnp.zeros(rank), slot_scale(rank, alpha, rank)]))
        graph, lora, rest = nnx.split(model, LoRAParam, ...)

        def loss(lora):
            return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(tokens, rows=rows)[0]) * w)

        grad_state = jax.jit(jax.grad(loss))(lora)
        grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grad_state)}
        peft_model.zero_grad()
        (torch.tanh(peft_model(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
        assert any("shared_expert" in k for k in flat)
        for key in flat:
            for index, name in hf_names(key, cfg, grads[key].shape):
                want = peft_factor(modules, name, key[-1]).weight.grad.numpy()
                np.testing.assert_allclose(grads[key][index].T, want, atol=1e-4, rtol=0, err_msg=name)
    finally:
        peft_model.unload()  # the module-scoped transformers model goes back to its plain form


def hf_names(key: tuple[str, ...], cfg: ModelConfig, shape) -> list[tuple[tuple, str]]:
    """(index of slot 1 in our array, HF module name) for each stacked entry."""
    module = key[:-1]
    if module[:2] != ("model", "layers"):
        return [((1,), ".".join(module))]
    layers = cfg.layers_holding(module[2])
    return [((i, 1), ".".join((*module[:2], str(layers[i]), *module[2:]))) for i in range(shape[0])]


def peft_factor(modules: dict, name: str, which: str) -> torch.nn.Module:
    return getattr(modules["base_model.model." + name], "lora_A" if which == "lora_a" else "lora_B")["default"]


@pytest.mark.parity
def test_peft_export_writes_the_experts_fused(models, tmp_path):
    """The pinned peft has no per-expert -> fused conversion for this family (it would drop those adapters),
    so the experts go out in the target_parameters form: peft reproduces our logits, it reads back, and
    merges into the checkpoint with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _, _, _ = models()
    model, cfg = load_model(str(path), lora=LoRASpec(2, 4), progress=False)
    rng = np.random.RandomState(6)
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.asarray(0.1 * rng.randn(*var.shape), jnp.float32))
    targets = adapters.adapter_targets(nnx.state(model, LoRAParam))
    weights = adapters.read_slot(nnx.state(model, LoRAParam), 1, 4, targets, lambda p, i: cfg.layers_holding(p[2])[i])
    config = peft.AdapterConfig(4, 8.0, tuple(sorted(targets)), str(path))
    peft.save_peft(tmp_path / "fused", config, weights, fused_experts=True)
    peft.save_peft(tmp_path / "per_expert", config, weights)
    ids = tokens_for(cfg, (1, 20), seed=11)
    rows = LoRARows(jnp.ones(1, jnp.int32), jnp.stack([jnp.zeros(4), slot_scale(4, 8.0, 4)]))
    mine = np.asarray(model(ids, rows=rows)[0])
    logits = {}
    for form in ("fused", "per_expert"):
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(tmp_path / form)).eval()
        with torch.no_grad():
            logits[form] = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits["fused"], mine, atol=1e-4, rtol=0)
    assert np.abs(logits["per_expert"] - mine).max() > 1e-2  # why this family exports fused
    config_back, back = peft.load_peft(tmp_path / "fused")
    assert set(back) == set(weights)
    merge_to_hf(path, tmp_path / "merged", config_back, back)  # into the per-expert checkpoint tensors
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(torch.tensor(ids, dtype=torch.long))
    np.testing.assert_allclose(merged.logits.numpy(), mine, atol=1e-4, rtol=0)


def test_prefill_then_decode_matches_full_forward(models):
    _, _, model, cfg = models()
    B, P, N = 2, 7, 5
    tokens = tokens_for(cfg, (B, P + N), seed=2)
    full, _ = model(tokens)
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = step(tokens[:, :P], positions, HybridCache.zeros(cfg, B, 16))
    outs = [logits]
    for i in range(P, P + N):
        logits, cache = step(tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_packed_rows_match_each_sequence_alone(models):
    """Attention, the DeltaNet's conv window and state and the routed experts all stay inside a segment."""
    _, _, model, cfg = models()
    seqs = [tokens_for(cfg, (1, n), seed=n)[0] for n in (5, 9, 3)]
    assert_packed_rows_match_alone(model, seqs, width=20)


def test_expert_mesh_matches_single_device(models):
    """The routed experts split over the expert axis (the shared expert and the mixers on tp, the batch on
    data; one mesh with every axis, so one compile), in the blocked product (blocks of 2 rows: its loop
    indexes the sharded expert weights): one device's logits and gradients (there, the dense product)."""
    from tx.models.sharding import make_mesh

    path, _, model, cfg = models()
    blocked = dataclasses.replace(CPU, moe_block_rows=2)
    sharded, _ = load_model(str(path), mesh=make_mesh(data=2, expert=2, tp=2), progress=False, tuning=blocked)
    assert (
        model.model.layers.mlp.form_for(48) == ("dense", 128) and sharded.model.layers.mlp.form_for(48)[0] == "blocked"
    )
    experts = sharded.model.layers.mlp.experts.gate_proj.weight[...]
    assert experts.sharding.spec[1] == "expert" and len(experts.sharding.device_set) == 8
    tokens = tokens_for(cfg, (4, 12), seed=9)
    assert_sharded_matches_one_device(model, sharded, tokens)
    step = tokens_for(cfg, (2, 1), seed=10)  # a decode step's 4 pairs (<= X): the pairs form on the mesh
    assert sharded.model.layers.mlp.form_for(step.size) == ("pairs", 1)
    got, want = (jax.jit(lambda t, m=m: m(t)[0])(step) for m in (sharded, model))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

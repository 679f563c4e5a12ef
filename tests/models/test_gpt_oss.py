"""gpt-oss against transformers (torch CPU, float32): logits in both expert-product forms (sinks, sliding
window, biases, YaRN, the clamped SwiGLU and the interleaved gate_up all in play), every weight's gradient,
packed rows, prefill + decode in both cache forms across the window, the checkpoint written back loading
into transformers, and meshes with an expert axis against one device (LoRA: test_gpt_oss_lora.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import GPT_OSS, build_gpt_oss
from flax import nnx
from models.family_checks import assert_packed_rows_match_alone, assert_sharded_matches_one_device, tokens_for

from tx.models.causal_lm import KVCache, LayerCache, per_layer, split_layers
from tx.models.config import ModelConfig
from tx.models.sharding import make_mesh
from tx.models.weights import load_model, save_hf
from tx.tuning import CPU

HF = GPT_OSS
FORMS = {
    "ragged": dataclasses.replace(CPU, moe_dense_max_experts=0, moe_block_rows=0),
    "dense": dataclasses.replace(CPU, moe_dense_max_experts=64, moe_block_rows=0),
    "blocked": dataclasses.replace(CPU, moe_block_rows=2),  # blocks of 2 rows: several per expert, some padded
}


@pytest.fixture(scope="module")
def hf_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, build_gpt_oss(path)


@pytest.fixture(scope="module")
def loaded(hf_oss):
    cache: dict = {}

    def get(form: str = "dense"):
        if form not in cache:
            cache[form] = load_model(str(hf_oss[0]), progress=False, tuning=FORMS[form])
        return cache[form]

    return get


def reference(ref, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_logits_match_transformers(hf_oss, loaded, form):
    model, cfg = loaded(form)
    tokens = tokens_for(cfg, (2, 12))
    assert model.model.layers.mlp.form_for(tokens.size)[0] == form
    assert cfg.sliding_layers == (0,) and cfg.sliding_window == 4
    got, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(got), reference(hf_oss[1], tokens), atol=1e-4, rtol=0)


def torch_name(key: tuple[str, ...], layer: int | None) -> tuple[str, bool]:
    """Our weight path (layer `layer` of its stack) -> (transformers' parameter, whether it is the
    transpose of ours: the fused experts' weights are [X, in, out], ours [X, out, in])."""
    if layer is None:
        return ".".join(key), False
    name = ".".join((*key[:2], str(layer), *key[2:]))
    if "experts" not in key:
        return name, False
    if key[-1] == "bias":
        return name.removesuffix(".bias") + "_bias", False
    return name.removesuffix(".weight"), True


def loss_weights(cfg: ModelConfig, shape) -> np.ndarray:
    return np.random.RandomState(7).randn(*shape, cfg.vocab_size).astype(np.float32) / cfg.vocab_size


@pytest.mark.parity
@pytest.mark.parametrize("form", list(FORMS))
def test_full_gradients_match_torch_autograd(hf_oss, loaded, form):
    """Every weight's gradient: sinks, biases, router, the fused experts."""
    _, ref = hf_oss
    model, cfg = loaded(form)
    tokens = tokens_for(cfg, (2, 10), seed=3)
    w = loss_weights(cfg, tokens.shape)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graph, params, rest)(tokens)
        return jnp.sum(jnp.tanh(logits) * w)

    grads = jax.jit(jax.grad(loss))(params)
    ref.zero_grad()
    (torch.tanh(ref(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    torch_params = dict(ref.named_parameters())
    checked = set()
    for p, var in nnx.to_flat_state(grads):
        key, mine = tuple(map(str, p)), np.asarray(var.get_value())
        for i in range(cfg.num_layers) if key[:2] == ("model", "layers") else [None]:
            name, transposed = torch_name(key, i)
            want = torch_params[name].grad.numpy()
            got = mine if i is None else mine[i]
            got = got.transpose(0, 2, 1) if transposed else got
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
            checked.add(name)
    assert checked == set(torch_params)


def test_packed_rows_match_each_sequence_alone(loaded):
    """Each segment sees its own window and sinks: positions restart, attention stays inside."""
    model, cfg = loaded()
    seqs = [tokens_for(cfg, (1, n), seed=n)[0] for n in (6, 9, 3)]
    assert_packed_rows_match_alone(model, seqs, width=20)


@pytest.mark.parametrize("per_layer_weights", [False, True])
def test_prefill_then_decode_matches_full_forward(loaded, per_layer_weights):
    """A prompt longer than the window, then decode steps past it, in the stacked `KVCache` form and in the
    `LayerCache` over per-layer weights (the CPU sampler's): the sliding layer must forget what left the
    window in the cache too, and each step's sinks join its softmax. A 3-token chunk exercises the
    multi-token cached path."""
    model, cfg = loaded()
    B, P, N = 2, 7, 6
    tokens = tokens_for(cfg, (B, P + N + 3), seed=2)
    full, _ = model(tokens)
    layers = None
    if per_layer_weights:
        flat = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
        _, layers = per_layer(split_layers(flat))
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache, layers=layers))
    cache = LayerCache.zeros(cfg, B, 32) if per_layer_weights else KVCache.zeros(cfg, B, 32)
    logits, cache = step(tokens[:, :P], jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache)
    outs = [logits]
    for i in range(P, P + N):
        logits, cache = step(tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        outs.append(logits)
    chunk = jnp.broadcast_to(jnp.arange(P + N, P + N + 3, dtype=jnp.int32), (B, 3))
    outs.append(step(tokens[:, P + N :], chunk, cache)[0])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_saved_checkpoint_loads_into_transformers(hf_oss, loaded, tmp_path):
    """`save_hf` writes the experts back fused ([X, in, out], `*_bias`) as transformers reads them: with the
    sinks and one expert's weights changed, transformers' logits on the written checkpoint equal ours on it
    and differ from the original's."""
    from transformers import GptOssForCausalLM

    model, cfg = loaded()
    flat = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    edits = {"sinks": 1.5, "gate_up_proj": 1.2}
    flat = {p: v * edits.get(p[-2] if p[-1] != "sinks" else "sinks", 1.0) for p, v in flat.items()}
    save_hf(flat, cfg, hf_oss[0], tmp_path / "out")
    back = GptOssForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = tokens_for(cfg, (1, 10), seed=5)
    mine, _ = load_model(str(tmp_path / "out"), progress=False, tuning=FORMS["dense"])[0](tokens)
    np.testing.assert_allclose(np.asarray(mine), reference(back, tokens), atol=1e-4, rtol=0)
    assert np.abs(reference(back, tokens) - reference(hf_oss[1], tokens)).max() > 1e-2


@pytest.mark.parametrize("mesh_sizes", [dict(expert=4), dict(expert=2, tp=2)])
def test_expert_mesh_matches_single_device(hf_oss, loaded, mesh_sizes):
    """The experts (and their biases) split over the expert axis, heads and sinks over tp."""
    model, cfg = loaded()
    tokens = tokens_for(cfg, (4, 12), seed=9)
    sharded, _ = load_model(str(hf_oss[0]), mesh=make_mesh(**mesh_sizes), progress=False, tuning=FORMS["dense"])
    experts = sharded.model.layers.mlp.experts
    assert experts.gate_up_proj.weight[...].sharding.spec[1] == "expert"
    assert experts.down_proj.bias[...].sharding.spec[1] == "expert"
    if "tp" in mesh_sizes:
        assert sharded.model.layers.self_attn.sinks[...].sharding.spec[1] == "tp"
    assert_sharded_matches_one_device(model, sharded, tokens)


@pytest.mark.parity
def test_a_config_without_window_or_rope_takes_transformers_defaults(hf_oss, tmp_path):
    """A config.json that names no `sliding_window` (transformers: 128) and no rotary scaling (transformers:
    its default YaRN) read as no window and no scaling: logits 0.6 and 2.9 off."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(hf_oss[0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sliding_window", "rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.config.sliding_window == 128 and ref.config.rope_parameters["rope_type"] == "yarn"
    model, cfg = load_model(str(tmp_path), progress=False, tuning=FORMS["dense"])
    assert cfg.sliding_window == 128
    tokens = tokens_for(cfg, (1, 160))
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), reference(ref, tokens), atol=1e-4, rtol=0)

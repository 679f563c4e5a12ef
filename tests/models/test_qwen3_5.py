"""Qwen3.5 against transformers (torch CPU, float32): logits of both checkpoint classes, LoRA and full
gradients, packed rows, prefill + decode, a missing tensor named, and compile size flat in depth."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import QWEN3_5_TEXT as TEXT
from conftest import build_qwen3_5 as build
from flax import nnx
from models.family_checks import assert_packed_rows_match_alone, tokens_for
from safetensors.numpy import load_file, save_file

from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.models.cache import HybridCache
from tx.models.config import ModelConfig
from tx.models.qwen3_5 import abstract_qwen3_5
from tx.models.weights import hf_key_to_path, load_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict = {}

    def get(multimodal: bool = False, tied: bool = False):
        if (multimodal, tied) not in cache:
            path = tmp_path_factory.mktemp(f"qwen3_5-{'mm' if multimodal else 'text'}-{tied}")
            cache[multimodal, tied] = (path, build(path, multimodal, tied))
        return cache[multimodal, tied]

    return get


@pytest.mark.parity
@pytest.mark.parametrize("multimodal,tied", [(False, False), (True, False), (True, True)])
def test_logits_match_transformers(models, multimodal, tied):
    path, ref = models(multimodal, tied)
    model, cfg = load_model(str(path), progress=False)
    assert cfg.tie_word_embeddings == tied and cfg.checkpoint_prefix.endswith("language_model") == multimodal
    tokens = tokens_for(cfg, (2, 80))  # two chunks of the delta rule, the second one partial
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def torch_param(ref, cfg: ModelConfig, path: tuple[str, ...], index: int | None) -> torch.nn.Parameter:
    """The torch parameter for our `path` (layer `index` of its stack)."""
    params = dict(ref.named_parameters())
    if index is None:
        return params[".".join(path)]
    layer = cfg.layers_holding(path[2])[index]
    return params[".".join((*path[:2], str(layer), *path[2:]))]


def loss_weights(cfg: ModelConfig, shape) -> np.ndarray:
    return np.random.RandomState(7).randn(*shape, cfg.vocab_size).astype(np.float32) / cfg.vocab_size


@pytest.mark.parity
def test_full_gradients_match_torch_autograd(models):
    path, ref = models()
    model, cfg = load_model(str(path), progress=False)
    tokens = tokens_for(cfg, (2, 70), seed=3)
    w = loss_weights(cfg, tokens.shape)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graph, params, rest)(tokens)
        return jnp.sum(jnp.tanh(logits) * w)

    grads = jax.grad(loss)(params)
    ref.zero_grad()
    (torch.tanh(ref(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    checked = 0
    for p, var in nnx.to_flat_state(grads):
        key = tuple(map(str, p))
        mine = np.asarray(var.get_value())
        for i in range(mine.shape[0]) if key[:2] == ("model", "layers") else [None]:
            want = torch_param(ref, cfg, key, i).grad.numpy()
            np.testing.assert_allclose(mine if i is None else mine[i], want, atol=1e-4, rtol=0, err_msg=str((key, i)))
            checked += 1
    assert checked == len(list(ref.parameters()))


def lora_targets(model) -> dict[tuple[str, ...], nnx.Variable]:
    return {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}


@pytest.mark.parity
def test_lora_gradients_match_peft(models):
    """Slot 1 holds a random rank-4 adapter on every projection (both layer types and lm_head); our
    gradients of A and B equal those of the same PEFT adapter on the transformers model."""
    from peft import LoraConfig, get_peft_model

    path, ref = models()
    rank, alpha = 4, 8.0
    model, cfg = load_model(str(path), lora=LoRASpec(2, rank), progress=False)
    rng = np.random.RandomState(5)
    for var in lora_targets(model).values():
        var.set_value(jnp.asarray(0.05 * rng.randn(*var.shape), jnp.float32))
    names = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj"]
    names += ["o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    peft_model = get_peft_model(ref, LoraConfig(r=rank, lora_alpha=alpha, target_modules=names))
    modules = dict(peft_model.named_modules())
    flat = lora_targets(model)
    for key, var in flat.items():
        module_path, which = key[:-1], key[-1]
        stacked = module_path[:2] == ("model", "layers")
        for i in range(var.shape[0]) if stacked else [None]:
            value = np.asarray(var.get_value())[i, 1] if stacked else np.asarray(var.get_value())[1]
            layer = None if i is None else cfg.layers_holding(module_path[2])[i]
            name = ".".join(module_path if layer is None else (*module_path[:2], str(layer), *module_path[2:]))
            target = getattr(modules["base_model.model." + name], "lora_A" if which == "lora_a" else "lora_B")
            target["default"].weight.data = torch.tensor(value.T.copy())
    tokens = tokens_for(cfg, (2, 70), seed=4)
    w = loss_weights(cfg, tokens.shape)
    rows = LoRARows(jnp.ones(2, jnp.int32), jnp.stack([jnp.zeros(rank), slot_scale(rank, alpha, rank)]))
    graph, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        logits, _ = nnx.merge(graph, lora, rest)(tokens, rows=rows)
        return jnp.sum(jnp.tanh(logits) * w)

    grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.grad(loss)(lora))}
    peft_model.zero_grad()
    (torch.tanh(peft_model(torch.tensor(tokens, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    for key, grad in grads.items():
        module_path, which = key[:-1], key[-1]
        stacked = module_path[:2] == ("model", "layers")
        for i in range(grad.shape[0]) if stacked else [None]:
            layer = None if i is None else cfg.layers_holding(module_path[2])[i]
            name = ".".join(module_path if layer is None else (*module_path[:2], str(layer), *module_path[2:]))
            target = getattr(modules["base_model.model." + name], "lora_A" if which == "lora_a" else "lora_B")
            mine = grad[i, 1] if stacked else grad[1]
            np.testing.assert_allclose(mine.T, target["default"].weight.grad.numpy(), atol=1e-4, rtol=0, err_msg=name)


def test_packed_rows_match_each_sequence_alone(models):
    """Three sequences in one row (one spans a chunk boundary of the delta rule) and trailing padding."""
    path, _ = models()
    model, cfg = load_model(str(path), progress=False)
    lengths = [5, 70, 9]
    seqs = [tokens_for(cfg, (1, n), seed=n)[0] for n in lengths]
    assert_packed_rows_match_alone(model, seqs, width=96)


def test_missing_tensor_of_a_linear_layer_is_named(models, tmp_path):
    path, _ = models(multimodal=True)
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors)  # present in the checkpoint, skipped by the loader
    del tensors["model.language_model.layers.5.linear_attn.A_log"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'model.language_model.layers.5.linear_attn.A_log'"):
        load_model(str(tmp_path / "m"), progress=False)
    assert hf_key_to_path("model.language_model.layers.5.linear_attn.A_log", "model.language_model") == (
        ("model", "layers", "linear_attn", "A_log"),
        5,
    )


def hlo_size(layers: int) -> int:
    """Lines of the lowered forward pass of a random (abstract) model with `layers` layers, 3:1 pattern."""
    hf = json.loads(json.dumps({**TEXT, "num_hidden_layers": layers, "architectures": ["Qwen3_5ForCausalLM"]}))
    hf.pop("initializer_range")
    cfg = ModelConfig.from_hf(hf)
    graph, state = nnx.split(abstract_qwen3_5(cfg, LoRASpec(2, 4)))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    lowered = jax.jit(lambda s, t: nnx.merge(graph, s)(t)[0]).lower(state, tokens)
    return len(lowered.as_text().splitlines())


def test_compiled_program_does_not_grow_with_depth():
    assert hlo_size(4) == hlo_size(16)


def test_prefill_then_decode_matches_full_forward(models):
    path, _ = models()
    model, cfg = load_model(str(path), progress=False)
    B, P, N = 2, 7, 6
    tokens = tokens_for(cfg, (B, P + N), seed=2)
    full, _ = model(tokens)
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = step(tokens[:, :P], positions, HybridCache.zeros(cfg, B, 32))
    outs = [logits]
    for i in range(P, P + N):
        logits, cache = step(tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_padded_prefill_and_shared_prompt_state(models):
    """Rows of different prompt lengths prefilled together (padding has segment 0 and writes nothing), then
    row 0's state copied to a third row (num_samples > 1), each row decoding its own next token."""
    path, _ = models()
    model, cfg = load_model(str(path), progress=False)
    lengths = [3, 9]
    seqs = [tokens_for(cfg, (1, n + 1), seed=10 + n)[0] for n in lengths]
    prompt, segments = np.zeros((2, 9), np.int32), np.zeros((2, 9), np.int32)
    for r, n in enumerate(lengths):
        prompt[r, :n], segments[r, :n] = seqs[r][:n], 1
    positions = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    positions[0, 3:] = 100  # beyond the cache: row 0's padding writes no keys
    _, cache = model(prompt, positions, segments, cache=HybridCache.zeros(cfg, 2, 16))
    cache = cache.take(jnp.array([0, 1, 0]), 16)
    other = (seqs[0][3] + 1) % cfg.vocab_size
    last = np.array([[seqs[0][3]], [seqs[1][9]], [other]], np.int32)
    logits, _ = model(last, np.array([[3], [9], [3]], np.int32), cache=cache)
    for r, (n, seq) in enumerate([(3, seqs[0]), (9, seqs[1]), (3, np.append(seqs[0][:3], other))]):
        alone, _ = model(seq[None, : n + 1])
        np.testing.assert_allclose(np.asarray(logits[r, 0]), np.asarray(alone[0, n]), atol=1e-5, rtol=0)


def test_greedy_decode_equals_transformers_generate(models):
    path, ref = models(multimodal=True)
    model, cfg = load_model(str(path), progress=False)
    prompt = tokens_for(cfg, (1, 6), seed=8)
    with torch.no_grad():
        want = ref.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=8, do_sample=False)[0, 6:].numpy()
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache))
    logits, cache = step(prompt, jnp.arange(6, dtype=jnp.int32)[None], HybridCache.zeros(cfg, 1, 16))
    got = []
    for i in range(6, 14):
        got.append(int(jnp.argmax(logits[0, -1])))
        logits, cache = step(jnp.array([[got[-1]]], jnp.int32), jnp.array([[i]], jnp.int32), cache)
    assert got == want.tolist()


def test_mesh_and_remat_match_single_device(models):
    """Weights on fsdp and on a tp axis wider than the key heads (those stay whole), one mesh so one compile
    of each program: one device's logits and gradients."""
    from tx.models.sharding import make_mesh

    data, fsdp, tp = 1, 2, 4
    path, _ = models()
    model, cfg = load_model(str(path), progress=False)
    tokens = tokens_for(cfg, (2, 24), seed=9)
    expected, _ = jax.jit(lambda t: model(t))(tokens)
    sharded, _ = load_model(str(path), mesh=make_mesh(data, fsdp, tp), remat=True, progress=False)
    assert len(sharded.model.layers.linear_attn.in_proj_qkv.weight[...].sharding.device_set) == data * fsdp * tp
    got, _ = jax.jit(lambda t: sharded(t))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)

    def loss(m):
        return jnp.sum(jnp.tanh(m(tokens)[0]))

    grads = [nnx.state(jax.jit(nnx.grad(loss))(m), nnx.Param) for m in (model, sharded)]
    for (p, mine), (_, want) in zip(nnx.to_flat_state(grads[1]), nnx.to_flat_state(grads[0]), strict=True):
        mine, want = np.asarray(mine.get_value()), np.asarray(want.get_value())  # summation order differs
        assert np.abs(mine - want).max() <= 1e-4 * np.abs(want).max(), p


def test_save_hf_writes_the_multimodal_checkpoint_back(models, tmp_path):
    """Full fine-tuning export: every tensor back under its own name, the vision tower copied unchanged."""
    from tx.models.weights import save_hf

    path, _ = models(multimodal=True)
    model, cfg = load_model(str(path), progress=False)
    params = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    save_hf(params, cfg, path, tmp_path / "out")
    original, written = (
        load_file(str(path / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert set(written) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


@pytest.mark.parity
@pytest.mark.parametrize(
    "extra",
    [{"layer_types": ["full_attention"] * 2, "num_hidden_layers": 2}, {"linear_conv_kernel_dim": 1}],
    ids=["no-linear-layers", "conv-kernel-1"],
)
def test_empty_recurrent_states_run(tmp_path, extra):
    """A stack without DeltaNet layers, or a convolution without a window (kernel 1), has zero-size states:
    their reshape to the layer stack divided by zero (ZeroDivisionError) at the first forward."""
    ref = build(tmp_path, False, **extra)
    model, cfg = load_model(str(tmp_path), progress=False)
    tokens = tokens_for(cfg, (2, 9))
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    full, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(full), want, atol=1e-4, rtol=0)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    _, cache = model(tokens[:, :8], positions, cache=HybridCache.zeros(cfg, 2, 16))
    last, _ = model(tokens[:, 8:], jnp.full((2, 1), 8, jnp.int32), cache=cache)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full)[:, 8:], atol=1e-5, rtol=0)

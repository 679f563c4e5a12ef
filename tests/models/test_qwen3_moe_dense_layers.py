"""Qwen3-MoE with dense layers (`mlp_only_layers`, `decoder_sparse_step`) against transformers (torch CPU,
float32): logits over the scanned and the per-layer weights, full gradients, a LoRA on attention, experts and
the dense MLPs exported as PEFT, merged, and its gradients, prefill + decode in both cache forms, the checkpoint's
names written back, and one layer body for any depth."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from test_qwen3_moe import decisive_qwen3_moe

from tx.lora import adapters, peft
from tx.lora.layers import LoRASpec
from tx.lora.merge import merge_to_hf
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.lora.targets import MLP_TARGETS, SOFTMAX_ATTN
from tx.models.causal_lm import KVCache, LayerCache, abstract_model, per_layer, split_layers
from tx.models.weights import load_model, save_hf
from tx.tuning import CPU

RANK, X = 4, 4
# decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense (mlp_only_layers: test_config_qwen3_moe.py).
HF = dict(
    vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=X, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=64, decoder_sparse_step=2,
)  # fmt: skip
SPARSE, DENSE = (1, 3), (0, 2)
ALPHA = 8.0
TARGETS = frozenset({*SOFTMAX_ATTN, *MLP_TARGETS, "lm_head"})
RAGGED = dataclasses.replace(CPU, moe_dense_max_experts=0)


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    """(checkpoint dir, torch model): routers that pick experts decisively."""
    ref = decisive_qwen3_moe(HF)
    path = tmp_path_factory.mktemp("qwen3_moe_dense")
    ref.save_pretrained(path)
    return path, ref


@pytest.fixture(scope="module")
def loaded(hf_dense):
    """(model with 3 adapter slots, slot 1 random, config)."""
    model, cfg = load_model(str(hf_dense[0]), lora=LoRASpec(3, RANK), progress=False, tuning=RAGGED)
    rng = np.random.RandomState(5)
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.asarray(0.1 * rng.randn(*var.shape), jnp.float32))
    return model, cfg


def tokens(shape=(2, 12), seed=3) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, HF["vocab_size"], shape).astype(np.int32)


def reference(ref, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def on_slot(slot: int, batch: int = 2) -> LoRARows:
    scale = jnp.stack([jnp.zeros(RANK), slot_scale(RANK, ALPHA, RANK), slot_scale(RANK, ALPHA, RANK)])
    return LoRARows(jnp.full(batch, slot, jnp.int32), scale)


@pytest.mark.parity
def test_logits_match_transformers_scanned_and_per_layer(hf_dense, loaded):
    model, cfg = loaded
    assert cfg.moe is not None and cfg.moe.sparse_layers == SPARSE and cfg.dense_mlp_layers == DENSE
    assert model.model.layers.mlp.gate_proj.weight.shape == (len(DENSE), 40, 32)
    assert model.model.layers.mlp.experts.gate_proj.weight.shape == (len(SPARSE), X, 16, 32)
    ids = tokens()
    want = reference(hf_dense[1], ids)
    flat = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    _, layers = per_layer(split_layers(flat))
    for weights in (None, layers):
        got, _ = model(ids, layers=weights)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    _, _, picks = model.hidden_and_picks(ids, jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), ids.shape))
    assert picks is not None and picks.shape == (len(SPARSE), ids.size, 2)


def torch_grad(ref, path: tuple[str, ...], layer: int | None) -> np.ndarray:
    """The torch gradient of our weight `path` at model layer `layer` (experts fused in transformers)."""
    params = dict(ref.named_parameters())
    if layer is None:
        return params[".".join(path)].grad.numpy()
    if "experts" not in path:
        return params[".".join((*path[:2], str(layer), *path[2:]))].grad.numpy()
    F, prefix = HF["moe_intermediate_size"], f"model.layers.{layer}.mlp.experts."
    fused = {"gate_proj": ("gate_up_proj", slice(0, F)), "up_proj": ("gate_up_proj", slice(F, None))}
    key, rows = fused.get(path[-2], ("down_proj", slice(None)))
    return params[prefix + key].grad.numpy()[:, rows]


@pytest.mark.parity
def test_full_gradients_match_torch_autograd(hf_dense, loaded):
    """Every weight's gradient at every layer: dense MLPs, routers and experts at their own layers."""
    _, ref = hf_dense
    model, cfg = loaded
    ids = tokens(seed=4)
    w = np.random.RandomState(7).randn(*ids.shape, HF["vocab_size"]).astype(np.float32) / HF["vocab_size"]
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return jnp.sum(jnp.tanh(nnx.merge(graph, params, rest)(ids)[0]) * w)

    grads = jax.jit(jax.grad(loss))(params)
    ref.zero_grad()
    (torch.tanh(ref(torch.tensor(ids, dtype=torch.long)).logits) * torch.tensor(w)).sum().backward()
    checked = 0
    for p, var in nnx.to_flat_state(grads):
        key, mine = tuple(map(str, p)), np.asarray(var.get_value())
        if isinstance(var, LoRAParam):
            continue
        holding = cfg.layers_holding(*key[2:4]) if key[:2] == ("model", "layers") else [None]
        for i, layer in enumerate(holding):
            want = torch_grad(ref, key, layer)
            np.testing.assert_allclose(mine if layer is None else mine[i], want, atol=1e-4, rtol=0, err_msg=str(key))
            checked += 1
    assert checked == len(list(ref.parameters())) + len(SPARSE)  # gate_up_proj is two weights of ours


@pytest.fixture(scope="module")
def exported(hf_dense, loaded, tmp_path_factory):
    """Slot 1's adapter saved as PEFT, module names numbered by model layer."""
    model, cfg = loaded
    state = nnx.state(model, LoRAParam)
    weights = adapters.read_slot(state, 1, RANK, TARGETS, cfg.stacked_layer)
    out = tmp_path_factory.mktemp("dense_adapter") / "adapter"
    peft.save_peft(out, peft.AdapterConfig(RANK, ALPHA, tuple(sorted(TARGETS)), str(hf_dense[0])), weights)
    return out


def test_export_names_each_module_at_its_layer(exported):
    _, names = peft.load_peft(exported)
    assert "model.layers.2.mlp.down_proj" in names and "model.layers.3.mlp.experts.2.up_proj" in names
    assert "model.layers.1.mlp.gate_proj" not in names and "model.layers.0.mlp.experts.0.up_proj" not in names
    assert len([n for n in names if ".mlp." in n]) == len(DENSE) * 3 + len(SPARSE) * X * 3


@pytest.mark.parity
def test_merged_adapter_gives_our_logits_and_lora_gradients(hf_dense, loaded, exported, tmp_path):
    """The export merged into the checkpoint and run by transformers gives slot 1's logits; torch's gradient G
    of each merged weight [out, in] gives each LoRA factor's (W + s (A B)^T: dA = s G^T B^T, dB = s A^T G^T),
    for the attention, the dense MLPs and every expert. (The pinned peft cannot load the dense layers' MLP
    adapters onto transformers 5's Qwen3-MoE: it retargets gate_proj / up_proj / down_proj to the experts.)"""
    from transformers import Qwen3MoeForCausalLM

    model, cfg = loaded
    merge_to_hf(hf_dense[0], tmp_path / "merged", *peft.load_peft(exported))
    ref = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = tokens(seed=6)
    w = np.random.RandomState(8).randn(*ids.shape, HF["vocab_size"]).astype(np.float32) / HF["vocab_size"]
    graph, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(ids, rows=on_slot(1))[0]) * w)

    grads = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss))(lora))}
    factors = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(lora)}
    logits = ref(torch.tensor(ids, dtype=torch.long)).logits
    mine, _ = model(ids, rows=on_slot(1))
    np.testing.assert_allclose(np.asarray(mine), logits.detach().numpy(), atol=1e-4, rtol=0)
    (torch.tanh(logits) * torch.tensor(w)).sum().backward()
    s = ALPHA / RANK
    for module in {key[:-1] for key in grads}:
        stacked = module[:2] == ("model", "layers")
        for i, layer in enumerate(cfg.layers_holding(*module[2:4])) if stacked else [(None, None)]:
            G = torch_grad(ref, (*module, "weight"), layer)  # [out, in], or [X, out, in] for experts
            a, b, da, db = (
                (x if i is None else x[i])[..., 1, :, :]
                for x in (
                    factors[(*module, "lora_a")],
                    factors[(*module, "lora_b")],
                    *(grads[(*module, f)] for f in ("lora_a", "lora_b")),
                )
            )
            want_a = s * np.einsum("...oi,...ro->...ir", G, b)
            want_b = s * np.einsum("...ir,...oi->...ro", a, G)
            np.testing.assert_allclose(da, want_a, atol=1e-4, rtol=0, err_msg=f"{module} {layer}")
            np.testing.assert_allclose(db, want_b, atol=1e-4, rtol=0, err_msg=f"{module} {layer}")


@pytest.mark.parametrize("per_layer_weights", [False, True])
def test_prefill_then_decode_matches_full_forward(loaded, per_layer_weights):
    model, cfg = loaded
    B, P, N = 2, 5, 4
    ids = tokens((B, P + N), seed=2)
    full, _ = model(ids, rows=on_slot(1))
    layers = None
    if per_layer_weights:
        flat = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
        _, layers = per_layer(split_layers(flat))
    step = jax.jit(lambda t, pos, cache: model(t, pos, rows=on_slot(1), cache=cache, layers=layers))
    cache = LayerCache.zeros(cfg, B, 16) if per_layer_weights else KVCache.zeros(cfg, B, 16)
    logits, cache = step(ids[:, :P], jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache)
    outs = [logits]
    for i in range(P, P + N):
        logits, cache = step(ids[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_save_hf_writes_every_tensor_under_its_checkpoint_name(hf_dense, loaded, tmp_path):
    model, cfg = loaded
    params = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    params = {p: v for p, v in params.items() if p[-1] not in ("lora_a", "lora_b")}
    original = load_file(hf_dense[0] / "model.safetensors")
    for name, weights in (("stacked", params), ("split", split_layers(params))):
        save_hf(weights, cfg, hf_dense[0], tmp_path / name)
        written = load_file(tmp_path / name / "model.safetensors")
        assert set(written) == set(original)
        for key, value in original.items():
            np.testing.assert_array_equal(written[key], value, err_msg=key)


def test_one_layer_body_for_any_depth(loaded):
    """The scanned forward's program does not grow with depth: 6 and 12 layers, the dense ones placed
    differently, trace the same number of matmuls."""
    _, cfg = loaded

    def matmuls(layers: int, dense: tuple[int, ...]) -> int:
        moe = dataclasses.replace(cfg.moe, sparse_layers=tuple(i for i in range(layers) if i not in dense))
        model = abstract_model(cfg.replace(num_layers=layers, moe=moe), tuning=RAGGED)
        graph, state = nnx.split(model)
        ids = jnp.zeros((1, 8), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graph, s)(ids)[0])(state)
        return str(jaxpr).count("dot_general") + str(jaxpr).count("ragged_dot")

    assert matmuls(6, (0, 2, 3, 4)) == matmuls(12, (0, 2, 3, 4, 6, 8, 10))

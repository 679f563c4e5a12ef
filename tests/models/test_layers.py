"""The hand-written pieces of the decoder layer against their plain JAX definitions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.models.attention import AttentionMask
from tx.models.layers import rms_norm, swiglu
from tx.models.rotary import apply_rope, rope_frequencies


def test_swiglu_gradient_equals_autodiff_of_the_plain_expression():
    keys = jax.random.split(jax.random.key(0), 3)
    gate = 3.0 * jax.random.normal(keys[0], (4, 7, 16))
    up = jax.random.normal(keys[1], (4, 7, 16))
    d = jax.random.normal(keys[2], (4, 7, 16))

    def plain(g, u):
        return jnp.sum(jax.nn.silu(g) * u * d)

    def ours(g, u):
        return jnp.sum(swiglu(g, u) * d)

    np.testing.assert_allclose(ours(gate, up), plain(gate, up), rtol=1e-6)
    for mine, ref in zip(jax.grad(ours, (0, 1))(gate, up), jax.grad(plain, (0, 1))(gate, up), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)


def test_attention_matches_a_softmax_reference_with_packing_and_gqa():
    """Two packed sequences per row, 4 query heads on 2 kv heads: the layer's attention core (through
    `Attention.attend` on a bare module) equals softmax(q k^T / sqrt(E) + mask) v computed head by head."""
    from tx.models.config import ModelConfig
    from tx.models.layers import Attention
    from tx.tuning import PLAIN

    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_hidden_layers": 1,
            "vocab_size": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
        }
    )
    attn = Attention(cfg, None, (), PLAIN)
    B, T, H, K, E = 2, 6, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, T, H, E))
    k = jax.random.normal(keys[1], (B, T, K, E))
    v = jax.random.normal(keys[2], (B, T, K, E))
    segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]], jnp.int32)
    mask = AttentionMask(segments, segments, positions, positions)
    attn.o_proj = lambda out, rows: out  # type: ignore[method-assign]  # the heads' output before projection

    def ours(q, k, v):
        return attn.attend(q, k, v, mask, None).reshape(B, T, H, E)

    out = ours(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(ours(q, k, v))), (0, 1, 2))(q, k, v)

    def reference(q, k, v):
        allowed = np.asarray(mask.allowed())
        outs = []
        for h in range(H):
            s = jnp.einsum("bte,bse->bts", q[:, :, h], k[:, :, h // (H // K)]) / math.sqrt(E)
            p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
            outs.append(jnp.einsum("bts,bse->bte", p, v[:, :, h // (H // K)]))
        return jnp.stack(outs, axis=2)

    np.testing.assert_allclose(out, reference(q, k, v), rtol=1e-5, atol=1e-6)
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(reference(q, k, v))), (0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


def test_rms_norm_gradients_equal_autodiff_of_the_plain_expression():
    keys = jax.random.split(jax.random.key(2), 3)
    x = 2.0 * jax.random.normal(keys[0], (3, 5, 16))
    w = 1.0 + 0.1 * jax.random.normal(keys[1], (16,))
    d = jax.random.normal(keys[2], (3, 5, 16))

    def plain(x, w):
        return jnp.sum(w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * d)

    def ours(x, w):
        return jnp.sum(rms_norm(x, w, 1e-6) * d)

    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-6)
    for mine, ref in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)


def test_rope_gradient_is_the_inverse_rotation():
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (2, 6, 3, 8))
    d = jax.random.normal(keys[1], (2, 6, 3, 8))
    positions = jnp.array([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]], jnp.int32)
    inv_freq = rope_frequencies(8, 10000.0, None)

    def plain(x):
        angles = positions[..., None].astype(jnp.float32) * inv_freq
        angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
        rotated = jnp.concatenate([-x[..., 4:], x[..., :4]], -1)
        return x * jnp.cos(angles) + rotated * jnp.sin(angles)

    np.testing.assert_allclose(apply_rope(x, positions, inv_freq), plain(x), rtol=1e-6, atol=1e-6)
    mine = jax.grad(lambda x: jnp.sum(apply_rope(x, positions, inv_freq) * d))(x)
    ref = jax.grad(lambda x: jnp.sum(plain(x) * d))(x)
    np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_bfloat16_norms_round_where_the_reference_rounds(family):
    """Qwen3.5's offset norms and gpt-oss's multiply by the weight in float32 and round once; ours rounded
    the normalised input (and Qwen3.5's 1 + w) to bfloat16 first: a third of the outputs a bit off, each
    such error carried down the residual stream. Now bit for bit those of transformers' modules."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from tx.models.layers import RMSNorm

    rng = np.random.RandomState(0)
    x, w = rng.randn(64, 256).astype(np.float32) * 3, (rng.randn(256) * 0.05).astype(np.float32)
    stored = w if family == "qwen3_5" else 1 + w  # Qwen3.5 stores its norms zero-centred
    ref = (Qwen3_5RMSNorm if family == "qwen3_5" else GptOssRMSNorm)(256, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(stored))
    want = ref.to(torch.bfloat16)(torch.tensor(x).to(torch.bfloat16)).float().detach().numpy()
    offset = 1.0 if family == "qwen3_5" else 0.0  # an offset norm multiplies in float32 of itself
    ours = RMSNorm(256, 1e-6, jnp.bfloat16, offset=offset, f32_product=family == "gpt_oss")
    ours.weight[...] = jnp.asarray(stored, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32)), want)

"""`tx.models.attention.blocked_attention` against a plain softmax, one block and several, and the memory a
long training row needs with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tx.models import attention
from tx.models.attention import AttentionMask, blocked_attention

B, T, K, G, E = 2, 10, 2, 2, 8


def _inputs(seed: int = 0) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    qg = jax.random.normal(keys[0], (B, T, K, G, E))
    k = jax.random.normal(keys[1], (B, K, T, E))
    v = jax.random.normal(keys[2], (B, K, T, E))
    sinks = jax.random.normal(keys[3], (K, G))
    return qg, k, v, sinks


def _mask() -> AttentionMask:
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0], [1] * T], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0], list(range(T))], jnp.int32)
    return AttentionMask(segments, segments, positions, positions)


def _reference(qg, k, v, sinks, mask, window):  # type: ignore[no-untyped-def]
    """softmax over [the allowed keys' logits, the sink] of each query head, times the values."""
    s = jnp.einsum("btkge,bkse->bkgts", qg, k)
    s = jnp.where(mask.allowed(window)[:, None, None], s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, :, None, None], (*s.shape[:-1], 1))], -1)
    p = jax.nn.softmax(s, axis=-1)[..., :T]
    return jnp.einsum("bkgts,bkse->btkge", p, v).reshape(B, T, K * G * E)


@pytest.mark.parametrize("block", [None, 4, 16])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (3, True)])
def test_blocked_attention_and_its_gradients_equal_a_plain_softmax(block, window, with_sinks):
    """Packed segments (one row ends in padding), two query heads per kv head, with and without a sliding
    window and sinks; in one block, in three blocks of 4 (T = 10 padded to 12) and in one block of 16."""
    qg, k, v, sinks = _inputs()
    sinks = sinks if with_sinks else None
    mask = _mask()
    win = None if window is None else jnp.int32(window)
    probe = jax.random.normal(jax.random.key(9), (B, T, K * G * E))

    def ours(qg, k, v, sinks):  # type: ignore[no-untyped-def]
        return jnp.sum(blocked_attention(qg, k, v, mask, win, sinks, block=block) * probe)

    def plain(qg, k, v, sinks):  # type: ignore[no-untyped-def]
        return jnp.sum(_reference(qg, k, v, sinks, mask, win) * probe)

    np.testing.assert_allclose(
        blocked_attention(qg, k, v, mask, win, sinks, block=block), _reference(qg, k, v, sinks, mask, win), atol=2e-6
    )
    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    mine = jax.grad(ours, argnums)(qg, k, v, sinks)
    ref = jax.grad(plain, argnums)(qg, k, v, sinks)
    for name, a, b in zip(("queries", "keys", "values", "sinks"), mine, ref, strict=False):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


def test_keys_in_the_cache_layout_give_the_same_output():
    """`keys_es` (keys [B, K, E, S], the decode cache's layout) over a cache mask: as the [B, K, S, E] form."""
    qg, k, v, _ = _inputs(1)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = AttentionMask.of_cache(positions, T)
    want = blocked_attention(qg, k, v, mask, block=4)
    np.testing.assert_allclose(blocked_attention(qg, k.transpose(0, 1, 3, 2), v, mask, keys_es=True), want, atol=2e-6)


def test_query_block_keeps_the_scores_of_a_block_within_the_budget():
    assert attention.query_block(8, 8, 256, 256) == 256  # 16 MiB of scores: one block
    C = attention.query_block(1, 16, 4096, 4096)
    assert C < 4096 and C & (C - 1) == 0
    assert 16 * C * 4096 * 4 <= attention.SCORE_BLOCK_BYTES


def _train_temp_bytes(length: int) -> int:
    """Compiled temporaries of a full-gradient step of a 4-layer, 8-head model on one row of `length`."""
    from tx.models.causal_lm import abstract_model
    from tx.models.config import ModelConfig
    from tx.tuning import PLAIN

    hf = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "num_hidden_layers": 4, "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "float32", "tie_word_embeddings": True, "max_position_embeddings": 1 << 14,
    }  # fmt: skip
    graphdef, params = nnx.split(abstract_model(ModelConfig.from_hf(hf), tuning=PLAIN))

    def loss(params, tokens):  # type: ignore[no-untyped-def]
        model = nnx.merge(graphdef, params)
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        return jnp.sum(model.hidden(tokens, positions, jnp.ones_like(tokens))[0] ** 2)

    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_a_long_row_trains_in_memory_linear_in_its_length():
    """Doubling a row from 4096 to 8192 tokens a little more than doubles the step's temporaries (keeping
    every layer's probabilities would quadruple them), and the longer step needs far less than those
    probabilities (4 layers x 8 heads x 8192^2 float32 = 8 GiB)."""
    short, long = _train_temp_bytes(4096), _train_temp_bytes(8192)
    assert long < 3 * short
    assert long < 4 * 8 * 8192**2 * 4 / 8


@pytest.mark.parametrize("window,with_sinks", [(None, False), (300, True)])
def test_causal_tiles_and_their_gradients_equal_a_plain_softmax(window, with_sinks):
    """`tiled_attention` over a packed row of 700 tokens (3 tiles, padded to 768; segments crossing tile
    borders, padding at the end; with a 300-token window the first tiles drop out of later blocks' loops)
    equals the plain softmax, and so do its gradients."""
    from tx.models.attention_tiles import tiled_attention

    T = 700
    keys = jax.random.split(jax.random.key(3), 5)
    qg = jax.random.normal(keys[0], (1, T, K, G, E))
    k = jax.random.normal(keys[1], (1, K, T, E))
    v = jax.random.normal(keys[2], (1, K, T, E))
    sinks = jax.random.normal(keys[3], (K, G)) if with_sinks else None
    cuts = [0, 180, 410, 650, T]
    segments = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    for n, (a, b) in enumerate(zip(cuts[:-2], cuts[1:-1], strict=True)):
        segments[a:b], positions[a:b] = n + 1, np.arange(b - a)
    mask = AttentionMask(*(jnp.asarray(x)[None] for x in (segments, segments, positions, positions)))
    win = None if window is None else jnp.int32(window)
    probe = jax.random.normal(keys[4], (1, T, K * G * E))

    def ref(qg, k, v, sinks):  # type: ignore[no-untyped-def]
        s = jnp.einsum("btkge,bkse->bkgts", qg, k)
        s = jnp.where(mask.allowed(win)[:, None, None], s, -jnp.inf)
        if sinks is not None:
            s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, :, None, None], (*s.shape[:-1], 1))], -1)
        p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))[..., :T]  # padding queries (segment 0) see padding only
        return jnp.einsum("bkgts,bkse->btkge", p, v).reshape(1, T, K * G * E)

    def ours(qg, k, v, sinks):  # type: ignore[no-untyped-def]
        return tiled_attention(qg, k, v, mask, win, sinks)

    np.testing.assert_allclose(ours(qg, k, v, sinks), ref(qg, k, v, sinks), atol=2e-5)
    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    mine = jax.grad(lambda *a: jnp.sum(ours(*a) * probe), argnums)(qg, k, v, sinks)
    want = jax.grad(lambda *a: jnp.sum(ref(*a) * probe), argnums)(qg, k, v, sinks)
    for name, a, b in zip(("queries", "keys", "values", "sinks"), mine, want, strict=False):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4, err_msg=name)

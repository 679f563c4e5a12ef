"""The forward pass's other paths give the plain forward's answer: meshes, KV-cache decode, packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models.family_checks import assert_packed_rows_match_alone, tokens_for

from tx.models.causal_lm import KVCache
from tx.models.sharding import make_mesh
from tx.models.weights import load_model


@pytest.fixture(scope="module")
def qwen(hf_models):
    path, _ = hf_models("qwen3", 2, False)
    model, cfg = load_model(str(path), progress=False)
    return path, model, cfg


@pytest.mark.parametrize("data,fsdp,tp", [(1, 2, 4), (1, 8, 1), (1, 1, 2), (2, 2, 2)])
def test_mesh_matches_single_device(qwen, data, fsdp, tp):
    path, model, cfg = qwen
    tokens = tokens_for(cfg, (4, 16))
    expected, _ = jax.jit(lambda t: model(t))(tokens)
    mesh = make_mesh(data, fsdp, tp)
    sharded, _ = load_model(str(path), mesh=mesh, progress=False)
    kernel = sharded.model.layers.mlp.gate_proj.weight[...]
    assert len(kernel.sharding.device_set) == data * fsdp * tp or fsdp * tp == 1
    got, _ = jax.jit(lambda t: sharded(t))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_prefill_then_decode_matches_full_forward(qwen):
    _, model, cfg = qwen
    B, P, N, S = 3, 7, 6, 32
    tokens = tokens_for(cfg, (B, P + N), seed=2)
    full, _ = model(tokens)
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache))
    cache = KVCache.zeros(cfg, B, S)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = step(tokens[:, :P], positions, cache)
    outs = [logits]
    for i in range(P, P + N):
        pos = jnp.full((B, 1), i, jnp.int32)
        logits, cache = step(tokens[:, i : i + 1], pos, cache)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-4, rtol=0)


def test_a_long_prefill_on_the_cache_in_query_blocks_matches_full_forward(qwen, monkeypatch):
    """A 40-token prefill over a cache already holding 10 positions, with a score budget that makes it run
    in blocks of 16 queries (the last one padded): the same logits as the forward over all 50 tokens."""
    from tx.models import attention

    _, model, cfg = qwen
    B, P, N, S = 2, 10, 40, 64
    tokens = tokens_for(cfg, (B, P + N), seed=4)
    full, _ = model(tokens)
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 1 << 10)
    step = jax.jit(lambda t, pos, cache: model(t, pos, cache=cache))
    cache = KVCache.zeros(cfg, B, S)
    first, cache = step(tokens[:, :P], jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache)
    rest, _ = step(tokens[:, P:], jnp.broadcast_to(jnp.arange(P, P + N, dtype=jnp.int32), (B, N)), cache)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), np.asarray(full), atol=1e-4, rtol=0)


def test_decode_rows_at_different_positions(qwen):
    """Continuous batching: rows of one decode call sit at different positions of their sequences."""
    _, model, cfg = qwen
    lengths = [3, 9]
    seqs = [tokens_for(cfg, (1, n + 1), seed=10 + n)[0] for n in lengths]
    cache = KVCache.zeros(cfg, 2, 16)
    prompt = np.zeros((2, 9), np.int32)
    for r, n in enumerate(lengths):
        prompt[r, :n] = seqs[r][:n]
    positions = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    positions[0, 3:] = 100  # beyond the cache: dropped, so row 0's padding writes nothing
    _, cache = model(prompt, positions, cache=cache)
    last = np.array([[seqs[0][3]], [seqs[1][9]]], np.int32)
    logits, _ = model(last, np.array([[3], [9]], np.int32), cache=cache)
    for r, n in enumerate(lengths):
        alone, _ = model(seqs[r][None, : n + 1])
        np.testing.assert_allclose(np.asarray(logits[r, 0]), np.asarray(alone[0, n]), atol=1e-4, rtol=0)


def test_packed_rows_match_each_sequence_alone(qwen):
    _, model, cfg = qwen
    lengths = [5, 8, 3]
    seqs = [tokens_for(cfg, (1, n), seed=n)[0] for n in lengths]
    assert_packed_rows_match_alone(model, seqs, width=20)


def test_long_rows_in_causal_tiles_on_a_mesh_match_one_block_on_one_device(qwen, monkeypatch):
    """Two packed rows of 300 tokens: the logits and the weights' gradients on a data x fsdp x tp mesh with
    a score budget small enough for causal tiles (two tiles of 256) equal one block on one device."""
    from flax import nnx

    from tx.models import attention

    path, model, cfg = qwen
    tokens = tokens_for(cfg, (2, 300))
    segments = jnp.asarray(np.repeat([[1, 2]], 150, axis=1).reshape(1, 300).repeat(2, 0), jnp.int32)
    positions = jnp.asarray(np.tile(np.arange(150), 2)[None].repeat(2, 0), jnp.int32)

    def logits_and_grads(m):  # type: ignore[no-untyped-def]
        graph, params, rest = nnx.split(m, nnx.Param, ...)

        def loss(p):  # type: ignore[no-untyped-def]
            logits, _ = nnx.merge(graph, p, rest)(tokens, positions, segments)
            return jnp.mean(jnp.sin(logits)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return np.asarray(logits), jax.tree.map(np.asarray, grads)

    want_logits, want_grads = logits_and_grads(model)
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 1 << 10)
    sharded, _ = load_model(str(path), mesh=make_mesh(1, 2, 2), progress=False)
    got_logits, got_grads = logits_and_grads(sharded)
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-4)

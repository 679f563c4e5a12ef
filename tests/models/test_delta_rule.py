"""The chunked gated delta rule equals the token-by-token recurrence, values and gradients, with resets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.models.delta_rule import chunked_delta_rule, recurrent_delta_rule, unit_lower_inverse

B, T, H, E, M = 2, 37, 3, 8, 6


def inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)

    def unit(x):
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(jax.random.normal(keys[0], (B, T, H, E))) / np.sqrt(E)
    k = unit(jax.random.normal(keys[1], (B, T, H, E)))
    v = jax.random.normal(keys[2], (B, T, H, M))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
    state = jax.random.normal(keys[5], (B, H, E, M))
    # Resets inside chunks (5), on chunk boundaries (16, 24, 32) and a one-token sequence (31).
    resets = np.zeros((B, T), bool)
    resets[0, [5, 16]] = True
    resets[1, [24, 31, 32]] = True
    return q, k, v, g, beta, jnp.asarray(resets), state


@pytest.mark.parametrize("chunk", [4, 8, 16, 64])
def test_chunked_equals_recurrent(chunk):
    q, k, v, g, beta, resets, state = inputs()
    o_ref, s_ref = recurrent_delta_rule(q, k, v, g, beta, resets, state)
    o, s = chunked_delta_rule(q, k, v, g, beta, resets, state, chunk=chunk)
    np.testing.assert_allclose(o, o_ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(s, s_ref, atol=2e-6, rtol=0)


def test_chunked_gradients_equal_recurrent():
    *args, resets, state = inputs(1)

    def loss(rule, q, k, v, g, beta, state):
        o, s = rule(q, k, v, g, beta, resets, state)
        return jnp.sum(jnp.sin(o)) + jnp.sum(s * s)

    ref = jax.grad(lambda *a: loss(recurrent_delta_rule, *a), argnums=range(6))(*args, state)
    got = jax.grad(lambda *a: loss(lambda *b: chunked_delta_rule(*b, chunk=8), *a), argnums=range(6))(*args, state)
    for mine, want in zip(got, ref, strict=True):
        np.testing.assert_allclose(mine, want, atol=1e-5, rtol=0)


def test_a_reset_forgets_everything_before_it():
    q, k, v, g, beta, _, state = inputs(2)
    resets = jnp.zeros((B, T), bool).at[:, 20].set(True)
    o, s = chunked_delta_rule(q, k, v, g, beta, resets, state, chunk=8)
    o_alone, s_alone = chunked_delta_rule(*(x[:, 20:] for x in (q, k, v, g, beta)), resets[:, 20:], 0 * state, chunk=8)
    np.testing.assert_allclose(o[:, 20:], o_alone, atol=2e-6, rtol=0)
    np.testing.assert_allclose(s, s_alone, atol=2e-6, rtol=0)


@pytest.mark.parametrize("size", [1, 5, 8, 37, 64])
def test_unit_lower_inverse_equals_the_float64_inverse(size):
    A = jnp.tril(0.3 * jax.random.normal(jax.random.key(size), (3, 2, size, size)), -1)
    want = np.linalg.inv(np.eye(size) + np.asarray(A, np.float64))
    np.testing.assert_allclose(unit_lower_inverse(A), want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)

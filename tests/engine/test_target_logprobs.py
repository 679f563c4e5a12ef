"""The hand-differentiated target log-probabilities against autodiff of log_softmax + gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tx.engine.train_step import target_logprobs


def test_value_and_gradient_equal_autodiff_with_soft_and_repeated_targets():
    keys = jax.random.split(jax.random.key(0), 3)
    logits = 4.0 * jax.random.normal(keys[0], (2, 5, 11))
    targets = jax.random.randint(keys[1], (2, 5, 3), 0, 11)
    targets = targets.at[0, 0].set(jnp.array([4, 4, 7]))  # the same token twice in one position's targets
    weights = jax.random.normal(keys[2], (2, 5, 3))

    def plain(x):
        return jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), targets, axis=-1)

    np.testing.assert_allclose(target_logprobs(logits, targets), plain(logits), rtol=1e-6, atol=1e-6)
    mine = jax.grad(lambda x: jnp.sum(jnp.sin(target_logprobs(x, targets)) * weights))(logits)
    ref = jax.grad(lambda x: jnp.sum(jnp.sin(plain(x)) * weights))(logits)
    np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)

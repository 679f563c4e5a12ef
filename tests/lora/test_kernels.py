"""The LoRA product's forms keep each row to its own adapter, even when another slot's weights are extreme."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.lora.experts import ExpertAdapter, token_columns
from tx.lora.kernels import lora_delta
from tx.lora.params import LoRARows


@pytest.mark.parametrize("kernel", ["gather", "indexed", "grouped"])
@pytest.mark.parametrize("tokens", [1, 3])  # one token per row is the decode form
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_extreme_adapter_does_not_reach_the_rows_beside_it(kernel: str, tokens: int, dtype: jnp.dtype) -> None:
    """Slot 2 holds 3.4e38 (finite in float32, but its products overflow to inf, and past bfloat16's largest
    value, so inf there once cast): rows on slot 1 and without an adapter get exactly what they get with
    slot 2 zeroed; only slot 2's own row is not finite."""
    S, I, R, O = 3, 8, 4, 5
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (S, I, R))
    b = jax.random.normal(keys[1], (S, R, O))
    x = (jnp.abs(jax.random.normal(keys[2], (3, tokens, I))) + 1.0).astype(dtype)  # every slot-2 product overflows
    rows = LoRARows(jnp.array([1, -1, 2], jnp.int32), jnp.ones((S, R), jnp.float32))
    extreme = lora_delta(x, rows, a.at[2].set(3.4e38), b.at[2].set(3.4e38), kernel)  # type: ignore[arg-type]
    clean = lora_delta(x, rows, a.at[2].set(0.0), b.at[2].set(0.0), kernel)  # type: ignore[arg-type]
    np.testing.assert_array_equal(np.asarray(extreme[:2]), np.asarray(clean[:2]))
    assert np.isfinite(np.asarray(clean)).all() and not np.isfinite(np.asarray(extreme[2])).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_extreme_expert_adapter_does_not_reach_the_tokens_beside_it(dtype: jnp.dtype) -> None:
    """The experts' side-by-side slot columns: slot 2 at 3.4e38 leaves the tokens of slot 1 and of no
    adapter as they are with slot 2 zeroed, in the dense and the ragged expert forms."""
    X, G, I, R, O, T = 2, 3, 8, 4, 5, 2
    keys = jax.random.split(jax.random.key(1), 3)
    a, b = jax.random.normal(keys[0], (X, G, I, R)), jax.random.normal(keys[1], (X, G, R, O))
    x = (jnp.abs(jax.random.normal(keys[2], (3 * T, I))) + 1.0).astype(dtype)
    mask = token_columns(LoRARows(jnp.array([1, -1, 2], jnp.int32), jnp.ones((G, R))), T, dtype)
    extreme = ExpertAdapter.of(a.at[:, 2].set(3.4e38), b.at[:, 2].set(3.4e38), mask)
    clean = ExpertAdapter.of(a.at[:, 2].set(0.0), b.at[:, 2].set(0.0), mask)
    np.testing.assert_array_equal(np.asarray(extreme.dense(x)[:, : 2 * T]), np.asarray(clean.dense(x)[:, : 2 * T]))
    token, sizes = jnp.arange(3 * T) % (3 * T), jnp.array([3 * T, 0], jnp.int32)  # every token on expert 0
    ragged = extreme.ragged(x, token, sizes)[: 2 * T]
    np.testing.assert_array_equal(np.asarray(ragged), np.asarray(clean.ragged(x, token, sizes)[: 2 * T]))

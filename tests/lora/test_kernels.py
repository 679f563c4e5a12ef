"""The LoRA product's forms keep each row to its own adapter, even when another slot's weights are extreme."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.lora.kernels import lora_delta
from tx.lora.params import LoRARows


@pytest.mark.parametrize("kernel", ["gather", "indexed", "grouped"])
@pytest.mark.parametrize("tokens", [1, 3])  # one token per row is the decode form
def test_an_extreme_adapter_does_not_reach_the_rows_beside_it(kernel: str, tokens: int) -> None:
    """Slot 2 holds 3e38 (finite, but its products overflow to inf): rows on slot 1 and without an adapter
    get exactly what they get with slot 2 zeroed; only slot 2's own row is not finite."""
    S, I, R, O = 3, 8, 4, 5
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (S, I, R))
    b = jax.random.normal(keys[1], (S, R, O))
    x = jnp.abs(jax.random.normal(keys[2], (3, tokens, I))) + 1.0  # every product with slot 2 overflows
    rows = LoRARows(jnp.array([1, -1, 2], jnp.int32), jnp.ones((S, R), jnp.float32))
    extreme = lora_delta(x, rows, a.at[2].set(3e38), b.at[2].set(3e38), kernel)  # type: ignore[arg-type]
    clean = lora_delta(x, rows, a.at[2].set(0.0), b.at[2].set(0.0), kernel)  # type: ignore[arg-type]
    np.testing.assert_allclose(np.asarray(extreme[:2]), np.asarray(clean[:2]), rtol=1e-6, atol=1e-6)
    assert np.isfinite(np.asarray(clean)).all() and not np.isfinite(np.asarray(extreme[2])).all()

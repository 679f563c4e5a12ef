"""Packed host transfers (`tx.gather.packed_to_host` / `packed_to_device`): every leaf comes back bit for bit,
whatever its dtype and shape, placed as asked, through one buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tx.gather import packed_to_device, packed_to_host
from tx.models.sharding import make_mesh


def _tree() -> dict:
    rng = np.random.RandomState(0)
    return {
        "f32": jnp.asarray(rng.randn(3, 5).astype(np.float32)),
        "bf16": jnp.asarray(rng.randn(2, 2, 3).astype(ml_dtypes.bfloat16)),
        "count": (jnp.int32(-7), jnp.uint8(200)),
        "mask": jnp.array([[True, False, True]]),
        "empty": jnp.zeros((0, 4), jnp.float32),
        "nan": jnp.array([np.nan, -0.0, np.inf], jnp.float32),
    }


def test_a_tree_goes_to_the_host_and_back_bit_for_bit() -> None:
    tree = _tree()
    host = packed_to_host(tree)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    bases = {id(x.base) for x in jax.tree.leaves(host) if x.size}
    assert len(bases) == 1  # views into one transferred buffer
    mesh = make_mesh(1, 2, 4)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    back = packed_to_device(host, replicated)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for want, got in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.sharding == replicated
        np.testing.assert_array_equal(
            np.asarray(got).reshape(-1).view(np.uint8), np.asarray(want).reshape(-1).view(np.uint8)
        )
    assert packed_to_host({}) == {} and packed_to_device({}, replicated) == {}

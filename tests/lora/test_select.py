"""Adapter selection: a program that compacts the stacked slots to the ones its rows use (and their rank
bucket) computes the same adapter terms, and the same gradients, as the full stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.lora.kernels import lora_delta
from tx.lora.params import AdapterRoles, LoRARows, slot_scale
from tx.lora.select import Selection, rank_bucket, select, take_adapters

S, I, O, R = 6, 24, 20, 32
P_ROLES = AdapterRoles(frozenset({("p", "lora_a")}), frozenset({("p", "lora_b")}))
RANKS = {1: 4, 2: 8, 3: 16, 4: 32, 5: 2}  # slot -> rank; slot 0 is the zero slot


@pytest.fixture(scope="module")
def stack():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((S, I, R)).astype(np.float32)
    b = rng.standard_normal((S, R, O)).astype(np.float32)
    a[0], b[0] = 0.0, 0.0
    scale = np.zeros((S, R), np.float32)
    for slot, rank in RANKS.items():
        scale[slot] = np.asarray(slot_scale(rank, 2.0 * rank + 1, R))
        # Columns past the slot's rank hold junk: masking, not zeros, must keep them out.
        a[slot, :, rank:] = 7.0
    x = rng.standard_normal((5, 3, I)).astype(np.float32)
    return x, a, b, scale


def test_rank_bucket():
    assert [rank_bucket(r, 32) for r in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert rank_bucket(4, 4) == 4 and rank_bucket(20, 24) == 24


def test_select_lists_used_slots_padded():
    scale = np.zeros((S, R), np.float32)
    scale[1, :4] = 1.0
    scale[3, :16] = 2.0
    assert select([0, 0, 0], scale) is None
    sel = select([3, 0, 1, 3, 0], scale)
    assert sel is not None
    np.testing.assert_array_equal(sel.active, [1, 3])
    np.testing.assert_array_equal(sel.rows.slot, [1, -1, 0, 1, -1])
    assert sel.rank == 16 and sel.rows.scale.shape == (2, 16)
    three = select([1, 3, 5], scale)
    assert three is not None
    np.testing.assert_array_equal(three.active, [1, 3, 5, 0])  # padded to a power of two with slot 0
    assert not np.any(three.rows.scale[3])
    with pytest.raises(ValueError, match="outside the 6 slots"):
        select([S], scale)


@pytest.mark.parametrize("kernel", ["gather", "indexed", "grouped"])
@pytest.mark.parametrize("slots", [[1, 1, 1, 1, 1], [2, 0, 2, 0, 0], [0, 4, 1, 0, 5], [3, 1, 2, 5, 4]])
def test_compact_equals_full_stack(stack, kernel, slots):
    x, a, b, scale = stack
    full = lora_delta(jnp.asarray(x), LoRARows(jnp.asarray(slots, jnp.int32), jnp.asarray(scale)), a, b, kernel)
    sel = select(slots, scale)
    assert sel is not None
    cut = take_adapters({("p", "lora_a"): jnp.asarray(a), ("p", "lora_b"): jnp.asarray(b)}, sel, P_ROLES)
    got = lora_delta(jnp.asarray(x), sel.rows, cut[("p", "lora_a")], cut[("p", "lora_b")], kernel)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-4)
    for r, slot in enumerate(slots):
        if slot == 0:
            assert not np.any(np.asarray(got[r]))  # rows without an adapter get exactly nothing


@pytest.mark.parametrize("kernel", ["gather", "indexed"])
def test_compact_gradient_is_the_slot_slice_of_the_full_gradient(stack, kernel):
    x, a, b, scale = stack
    slots = [2, 0, 4, 2, 0]
    # The products reach |128|: sin of them unscaled turns float32 rounding (1e-5 relative, summed in another
    # order by each form) into gradient differences of 5e-4 against a float64 reference, for both forms.

    def loss_full(a_, b_):
        rows = LoRARows(jnp.asarray(slots, jnp.int32), jnp.asarray(scale))
        return jnp.sum(jnp.sin(lora_delta(jnp.asarray(x), rows, a_, b_, "gather") / 64))

    sel = select(slots, scale)
    assert isinstance(sel, Selection)

    def loss_compact(a_, b_):
        return jnp.sum(jnp.sin(lora_delta(jnp.asarray(x), sel.rows, a_, b_, kernel) / 64))

    ga, gb = jax.grad(loss_full, argnums=(0, 1))(jnp.asarray(a), jnp.asarray(b))
    cut = take_adapters({("p", "lora_a"): jnp.asarray(a), ("p", "lora_b"): jnp.asarray(b)}, sel, P_ROLES)
    ca, cb = jax.grad(loss_compact, argnums=(0, 1))(cut[("p", "lora_a")], cut[("p", "lora_b")])
    for index, slot in enumerate(np.asarray(sel.active)[:2]):
        rank = RANKS[int(slot)]
        np.testing.assert_allclose(ca[index][:, :rank], ga[slot][:, :rank], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cb[index][:rank], gb[slot][:rank], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slots", [[1, 1, 1, 1, 1], [2, 0, 2, 0, 0], [3, 1, 2, 5, 4]])
def test_one_token_rows_match_a_per_row_reference(stack, slots):
    """Decode rows (one token each) take the side-by-side form; every row equals its own adapter's
    x @ A[:, :rank] @ B[:rank] * scale, rows without an adapter exactly zero."""
    x, a, b, scale = stack
    x1 = x[:, :1]
    sel = select(slots, scale)
    assert sel is not None
    cut = take_adapters({("p", "lora_a"): jnp.asarray(a), ("p", "lora_b"): jnp.asarray(b)}, sel, P_ROLES)
    got = np.asarray(lora_delta(jnp.asarray(x1), sel.rows, cut[("p", "lora_a")], cut[("p", "lora_b")]))
    for r, slot in enumerate(slots):
        rank = RANKS.get(slot, 0)
        want = x1[r] @ a[slot, :, :rank] @ b[slot, :rank] * scale[slot, 0] if rank else np.zeros_like(got[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-4)
        if slot == 0:
            assert not np.any(got[r])


def test_decode_rows_use_the_weight_major_product():
    """A decode batch (one token per row, few rows) multiplies weight-major where the tuning says so (CPU),
    [O, I] x [I, B], and the result equals the plain product; XLA must not fold the transpose back (the
    compiled dot's output is [O, B]). The plain tuning (accelerators) and wider batches take x @ W.T."""
    from tx.lora.layers import linear
    from tx.tuning import CPU, for_backend

    few = CPU.weight_major_rows

    def product(x: jax.Array, w: jax.Array, rows: int) -> str:
        return jax.jit(linear, static_argnums=(2, 3)).lower(x, w, None, rows).compile().as_text()

    x = jax.random.normal(jax.random.key(0), (8, 1, 48))
    w = jax.random.normal(jax.random.key(1), (96, 48))
    np.testing.assert_allclose(linear(x, w, None, few), jnp.einsum("bti,oi->bto", x, w), rtol=1e-5, atol=1e-5)
    assert "f32[96,8]" in product(x, w, few) and "dot(" in product(x, w, few)
    assert "f32[96,8]" not in product(x, w, for_backend("gpu").weight_major_rows)
    wide = jax.random.normal(jax.random.key(2), (few + 1, 1, 48))  # more rows: the plain product
    assert f"f32[96,{few + 1}]" not in product(wide, w, few)
